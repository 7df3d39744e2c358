"""SFT warm-up: supervised steps on demonstrations before the algorithm's own, in the same run
(sft_warmup; InstructGPT's first stage, Ouyang et al. 2022, ahead of its RL stage).

The first `sft_warmup.steps` of trainer.steps each take `sft_warmup.batch_size` train rows (those of
data + sft_warmup.data where it is set; an order of their own, so the algorithm's steps then see the
data from its start, as a separate run would) and minimise the token-mean negative log-likelihood
of each row's demonstration (`sft_warmup.column`): text given its prompt, or a conversation's
assistant turns, rendered as the run's episodes render them (the tools' descriptions included;
rlnotes.agents.rendering), at `sft_warmup.lr` shaped by optim.schedule over the warm-up's steps
(linear: down to 0 at its end; no optim.warmup_steps). The next step starts the optimizer afresh
(Adam's moments of the supervised gradients would otherwise scale the first policy-gradient
steps), so the algorithm trains as a run from the warmed-up weights would. Checkpoints, stops and
resumes work as for any step: the warm-up's data position is its step count.
"""

from __future__ import annotations

from typing import Dict

from rlnotes.data.sampler import PromptSampler
from rlnotes.engine.hardware import distributed
from rlnotes.training.context import Context, Run
from rlnotes.training.offline import encode_demonstrations, nll_backward
from rlnotes.training.optimizer import lr_lambda, optimizer_step


def warming_up(run: Run, warm) -> bool:
    """Whether the next step is a warm-up step (of the sft_warmup section `warm`)."""
    return run.step < warm.steps


def warmup_step(ctx: Context) -> Dict[str, float]:
    """One supervised step on the next sft_warmup.batch_size rows (micro-batched like any step)."""
    cfg, warm, model, run, data = ctx.cfg, ctx.cfg.sft_warmup, ctx.model, ctx.run, ctx.data
    if data.warmup_sampler is None:  # made on this process's first warm-up step; a resumed run skips the batches done
        rows = data.sampler.rows if data.warmup_rows is None else data.warmup_rows
        data.warmup_sampler = PromptSampler(rows, warm.batch_size, cfg.seed + 1)
        for _ in range(run.step):
            data.warmup_sampler.next_batch()
    seqs = encode_demonstrations(model, distributed.shard(data.warmup_sampler.next_batch()), (warm.column,),
                                 ctx.rollouts.multi_turn)
    loss_sum = nll_backward(model, run, seqs, "token-mean")
    lr = warm.lr * lr_lambda(cfg.optim.schedule, 0, warm.steps)(run.step)
    for group in model.optimizer.param_groups:
        group["lr"] = lr  # the scheduler's step at the end sets the algorithm's rate again
    metrics = optimizer_step(model, run, ctx.out.console)
    if run.step == warm.steps:
        model.optimizer.state.clear()  # the algorithm's steps start with a fresh Adam
    return {**metrics, "optim/lr": lr, "sft_warmup/loss": loss_sum, "perf/tokens": seqs.tokens()}
