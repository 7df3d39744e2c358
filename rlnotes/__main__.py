from rlnotes.commands.cli import run

run()
