#!/usr/bin/env bash
# `make wheel-check`: rlnotes as a user installs it, not the editable install of `make test`, which
# imports straight from the tree and so hides whatever the wheel lacks.
#  1. the working tree as git sees it (tracked files and new ones it does not ignore) into a temp dir;
#  2. its sdist, and the wheel built from that sdist (python -m build);
#  3. a fresh venv: torch ($TORCH) first, then the wheel, not editable;
#  4. from empty dirs outside the repository: rlnotes --help, --version, and two 3-step runs (the
#     default and the multi-turn experiment=letters_env), each of which must write metrics.jsonl and final/.
# Every command is printed before it runs; the first failure stops the check with a nonzero status
# and leaves its temp dir for a look. PYTHON (the venv's interpreter) and TORCH come from the Makefile.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
TORCH="${TORCH:-torch==2.13.0}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/rlnotes-wheel-check.XXXXXX")"
venv="$tmp/venv"

finish() {
  local status=$?
  if [ "$status" -eq 0 ]; then
    rm -rf "$tmp"
    echo "wheel-check: OK in ${SECONDS} s"
  else
    echo "wheel-check: FAILED (exit $status) after ${SECONDS} s; its files are in $tmp" >&2
  fi
}
trap finish EXIT

step() { printf '\n==> %s (at %s s)\n' "$*" "$SECONDS"; }
run() { echo "+ $*" >&2; "$@"; }
fail() { echo "wheel-check: $*" >&2; exit 1; }

step "1. the working tree into $tmp/src"
mkdir "$tmp/src"
# --cached also lists tracked files deleted in the working tree: only files that exist are copied.
git -C "$repo" ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d '' f; do if [ -f "$repo/$f" ]; then printf '%s\0' "$f"; fi; done |
  tar -C "$repo" --null -T - -cf - | tar -C "$tmp/src" -xf -
version="$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$tmp/src/rlnotes/__init__.py")"
[ -n "$version" ] || fail "no __version__ in rlnotes/__init__.py"

step "2. the sdist, then the wheel from it"
run "$PYTHON" -m venv "$venv"
run "$venv/bin/python" -m pip install -q build
log="$tmp/build.log"  # its long log; the end of it is shown if it fails
run "$venv/bin/python" -m build -o "$tmp/dist" "$tmp/src" > "$log" 2>&1 || { tail -30 "$log"; exit 1; }
sdist="$tmp/dist/rlnotes-$version.tar.gz"
wheel="$tmp/dist/rlnotes-$version-py3-none-any.whl"
[ -f "$sdist" ] && [ -f "$wheel" ] || fail "python -m build made $(ls "$tmp/dist"), not $sdist and $wheel"
echo "$(basename "$sdist"): $(tar tzf "$sdist" | grep -c '/conf/.*\.yaml$') YAML files under conf/"
echo "$(basename "$wheel"): $("$venv/bin/python" -m zipfile -l "$wheel" | grep -c '^rlnotes/.*\.py ') modules," \
  "$("$venv/bin/python" -m zipfile -l "$wheel" | grep -c '^rlnotes/conf/.*\.yaml ') YAML files"

step "3. torch, then the wheel, into the fresh venv"
run "$venv/bin/python" -m pip install -q "$TORCH"
run "$venv/bin/python" -m pip install -q "$wheel"
rlnotes="$venv/bin/rlnotes"

step "4. the installed command, from empty dirs outside the repository"
mkdir "$tmp/empty"
cd "$tmp/empty"
installed="$(run "$venv/bin/python" -c 'import rlnotes; print(rlnotes.__file__)')"
echo "$installed"
case "$installed" in "$venv"/*) ;; *) fail "rlnotes was imported from $installed, not from the venv" ;; esac
run "$rlnotes" --help
printed="$(run "$rlnotes" --version)"
echo "$printed"
[ "$printed" = "rlnotes $version" ] || fail "rlnotes --version printed '$printed', not 'rlnotes $version'"

train() {  # train NAME ARGS...: `rlnotes train ARGS` in the empty dir $tmp/NAME; its run dir must hold the run
  local dir="$tmp/$1"
  shift
  mkdir "$dir"
  (cd "$dir" && run "$rlnotes" train "$@")
  local runs=("$dir"/outputs/*/*)
  [ "${#runs[@]}" -eq 1 ] && [ -d "${runs[0]}" ] || fail "rlnotes train $* made no single run dir under $dir/outputs"
  [ -s "${runs[0]}/metrics.jsonl" ] || fail "rlnotes train $*: no metrics.jsonl in ${runs[0]}"
  [ -d "${runs[0]}/final" ] || fail "rlnotes train $*: no final/ in ${runs[0]}"
  grep -qx "rlnotes_version: $version" "${runs[0]}/config.yaml" \
    || fail "rlnotes train $*: config.yaml does not record rlnotes_version: $version"
  echo "ok: ${runs[0]} holds metrics.jsonl ($(wc -l < "${runs[0]}/metrics.jsonl") rows), final/, config.yaml"
}
train default trainer.steps=3
train letters_env experiment=letters_env trainer.steps=3
