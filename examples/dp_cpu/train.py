"""A data-parallel trainer on CPU: torch.distributed (gloo) ranks, DistributedDataParallel, each rank its share.

The two recipes of docs/trainer.md "Data-parallel trainers", run for real against a coda-server:

* `--recipe shares` (the default): every rank iterates `pacer.batches(M, rank=r, world_size=w, run=...)` and gets
  its share of each global mini-batch from the server (whole groups, balanced by tokens, the same split on every rank;
  the run, new on every launch and torchrun restart, has ranks started again together begin at one mini-batch);
* `--recipe scatter`: rank 0 alone iterates `pacer.batches(M)`, splits each batch by tokens and scatters the shares
  with `dist.scatter_object_list`.

Generation is a `coda_worker.RolloutWorker` on `FakeEngine` on a thread of rank 0 (made-up tokens, long-tailed
lengths: this example checks the data path of a data-parallel trainer, not learning; examples/rl_cpu has a policy
that learns through the service). The model is a bigram policy wrapped in DDP, trained with a GRPO-style loss, so
the gradients really are all-reduced across the ranks. At each step boundary every rank waits at a barrier, then
rank 0 sends Reset(ABORT) and Resume; after the last step rank 0 ends the job.

The last line is a JSON summary, checked by tests/test_dp_example.py: groups trained, trained twice (must be 0),
lost (accepted by a Dispatch, neither trained nor named by end_job's report: must be 0), the largest difference
between the ranks' parameters after a step (must be 0: DDP keeps them equal), and the token imbalance of each
global mini-batch across the ranks (max/mean).

    coda-server &                                                       # default config, 127.0.0.1:50051
    python examples/dp_cpu/train.py                                     # 2 ranks, 3 steps, --recipe shares
    python examples/dp_cpu/train.py --recipe scatter --world-size 4
    python examples/dp_cpu/train.py --token-budget 4096                 # global mini-batches cut by tokens
    torchrun --nproc-per-node 2 examples/dp_cpu/train.py --address 127.0.0.1:50051   # launched by torchrun

Needs torch (any CPU build) and coda-pacer[numpy,worker].
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing
from torch.nn.parallel import DistributedDataParallel

from coda_client import MiniBatch, PacerClient, PacerClientError
from coda_worker import FakeEngine, ListPromptSource, Prompt, RolloutWorker

VOCAB = 64  # FakeEngine's token ids, and the bigram policy's vocabulary
BOUNDARY_WAIT_SECONDS = 30.0


class BigramPolicy(torch.nn.Module):
    """Next-token logits from the previous token alone: small, yet a real model whose gradients DDP all-reduces."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        self.logits = torch.nn.Embedding(vocab, vocab)

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.logits(previous), dim=-1)


def policy_loss(model: torch.nn.Module, batch: MiniBatch) -> torch.Tensor:
    """GRPO-style: each trajectory's advantage is its reward normalised within its group (the share holds the whole
    group, so no other rank is needed for it), times the log-probability of its response tokens."""
    columns = batch.to_torch()
    tokens = columns["token_ids"].long()
    previous = torch.roll(tokens, 1)
    starts = batch.cu_seqlens[:-1][batch.seqlens > 0]
    previous[torch.from_numpy(starts)] = 0  # a response's first token follows token 0 (no prompt in this model)
    logprobs = model(previous).gather(1, tokens[:, None])[:, 0]
    advantages = np.zeros(len(batch), dtype=np.float32)
    for group in batch.groups:
        rewards = group.reward
        advantages[group.start:group.stop] = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    per_token = torch.from_numpy(np.repeat(advantages, batch.seqlens))
    mask = columns["loss_mask"].float()
    return -(per_token * logprobs * mask).sum() / mask.sum().clamp(min=1.0)


def reward(prompt: Prompt, response: list[int]) -> float:
    """Stands for the verifier: the share of even tokens."""
    return sum(token % 2 == 0 for token in response) / max(1, len(response))


def split_by_tokens(groups: list, world_size: int) -> list[list]:
    """Whole groups, largest first, each to the share with the fewest tokens (then the fewest groups, so that
    groups without tokens do not all go to one rank and leave another with nothing)."""
    shares: list[list] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for group in sorted(groups, key=lambda g: -sum(len(t.token_ids) for t in g.trajectories)):
        lightest = min(range(world_size), key=lambda r: (loads[r], len(shares[r])))
        shares[lightest].append(group)
        loads[lightest] += sum(len(t.token_ids) for t in group.trajectories)
    return shares


class StepRecord:
    """What this rank trained: prompt ids, and tokens per mini-batch (gathered across ranks at the end)."""

    def __init__(self) -> None:
        self.prompt_ids: list[str] = []
        self.tokens: list[int] = []

    def trained(self, batch: MiniBatch) -> None:
        self.prompt_ids += [g.prompt_id for g in batch.groups]
        self.tokens.append(batch.num_tokens)


def train_step(model, optimizer, batch: MiniBatch, record: StepRecord) -> float:
    loss = policy_loss(model, batch)
    loss.backward()  # DDP all-reduces the gradients across the ranks here
    optimizer.step()
    optimizer.zero_grad()
    record.trained(batch)
    return loss.item()


def launch_run() -> str:
    """This launch's run, the same on every rank and new on every launch or restart: under torchrun its run id and
    restart count, else a value rank 0 makes and broadcasts (a collective: every rank calls it)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    made = [str(time.time_ns())]
    dist.broadcast_object_list(made, src=0)  # rank 0's value on every rank
    return made[0]


def train_shares(pacer: PacerClient, model, optimizer, record: StepRecord, rank: int, world_size: int,
                 M: int, batches_per_step: int, token_budget: int | None = None, run: str = "") -> None:
    """One step, the per-rank recipe: this rank's share of each of the step's global mini-batches (cut by
    `token_budget` response tokens instead of M trajectories when it is given). `run`: this launch's (launch_run):
    ranks started again together after a crash all begin at one new global mini-batch."""
    with pacer.batches(mini_batch_size=None if token_budget else M, token_budget=token_budget, rank=rank,
                       world_size=world_size, num_batches=batches_per_step, lease=600, run=run) as batches:
        for batch in batches:  # this rank's share of the next global mini-batch
            train_step(model, optimizer, batch, record)


def train_scatter(pacer: PacerClient, model, optimizer, record: StepRecord, rank: int, world_size: int,
                  M: int, batches_per_step: int, token_budget: int | None = None, run: str = "") -> None:
    """One step, the rank-0 recipe: rank 0 holds the iterator, splits each batch and scatters the shares (`run` goes
    unused: rank 0 collects alone, as a single trainer, and the other ranks get their shares from it)."""
    batches = pacer.batches(mini_batch_size=M, num_batches=batches_per_step, lease=600) if rank == 0 else None
    for _ in range(batches_per_step):
        shares = split_by_tokens(next(batches).source_groups, world_size) if rank == 0 else None
        received: list[Any] = [None]
        dist.scatter_object_list(received, shares, src=0)  # pickles the NumPy arrays: a copy per rank
        train_step(model, optimizer, MiniBatch.from_groups(received[0]), record)
    if rank == 0:
        batches.ack()  # the last batch, after every rank trained on its share
        batches.close()


def parameter_spread(model: torch.nn.Module) -> float:
    """The largest difference between any two ranks' values of any parameter (0 when DDP kept them equal)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return float((high - low).max())


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict | None:
    """One rank's life; rank 0 also runs the generation worker, the step boundaries and the job's end."""
    torch.manual_seed(rank)  # different on each rank: DDP's broadcast from rank 0 must make them equal
    torch.set_num_threads(1)
    model = DistributedDataParallel(BigramPolicy())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    pacer = PacerClient(args.address, arrays="numpy", client_id=f"rank-{rank}")
    state = pacer.state()
    M = state.mini_batch_size  # the GLOBAL mini-batch (trainer.mini_batch_size), all ranks together
    batches_per_step = state.prompts_per_step * state.group_sizes[0] // M
    worker = source = engine = None
    if rank == 0:
        source = ListPromptSource([Prompt(f"dp-p{i}", [1, 2, 3, i % VOCAB], epoch=0, index=i) for i in range(10_000)])
        engine = FakeEngine(seed=0, vocab_size=VOCAB, mean_tokens=32, seconds_per_token=0.0)
        worker = RolloutWorker(args.address, engine, source, worker_id="dp-rollout-0", max_groups=64,
                               reward=reward).start()
    record = StepRecord()
    spreads = []
    train = train_shares if args.recipe == "shares" else train_scatter
    run = launch_run()  # once per launch, before the steps
    for step in range(args.steps):
        train(pacer, model, optimizer, record, rank, world_size, M, batches_per_step, args.token_budget, run)
        spreads.append(parameter_spread(model))
        dist.barrier()  # every rank done with the step (its shares acknowledged)
        if rank == 0:  # the boundary: the workers abort and submit their partials, the new weights, Resume
            pacer.reset("abort", wait=BOUNDARY_WAIT_SECONDS)
            asyncio.run(engine.sync_weights(f"weights/step-{step + 1}", step + 1))
            pacer.resume(step + 1)
        dist.barrier()
    trained: list[Any] = [None] * world_size
    dist.all_gather_object(trained, (record.prompt_ids, record.tokens))
    summary = None
    if rank == 0:
        report = pacer.end_job("abort", wait=BOUNDARY_WAIT_SECONDS)
        worker.join(timeout=BOUNDARY_WAIT_SECONDS)
        summary = summarize(trained, report, started=10_000 - len(source), spreads=spreads, args=args,
                            world_size=world_size, M=M, batches_per_step=batches_per_step)
    pacer.close()
    dist.barrier()  # no rank tears the process group down while another (rank 0, ending the job) still uses it
    return summary


def summarize(trained: list, report, *, started: int, spreads: list[float], args, world_size: int, M: int,
              batches_per_step: int) -> dict:
    prompt_ids = [p for ids, _ in trained for p in ids]
    state = report.state
    per_batch = np.array([tokens for _, tokens in trained], dtype=np.float64)  # [rank, mini-batch]
    imbalance = (per_batch.max(axis=0) / per_batch.mean(axis=0)).round(3).tolist()
    return {
        "recipe": args.recipe, "token_budget": args.token_budget, "world_size": world_size, "steps": args.steps,
        "mini_batch_size": M, "mini_batches": batches_per_step * args.steps,
        "groups_trained": len(set(prompt_ids)), "groups_trained_per_rank": [len(ids) for ids, _ in trained],
        "trained_twice": len(prompt_ids) - len(set(prompt_ids)),
        "lost": started - len(set(prompt_ids)) - report.left_over - state.dropped - state.filtered,
        "left_over": report.left_over, "max_parameter_spread": max(spreads),
        "token_imbalance_per_mini_batch": imbalance,
    }


def rank_entry(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    """A spawned rank: join the process group on loopback, run, print the summary from rank 0."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        summary = run_rank(rank, world_size, args)
        if summary is not None:
            print(json.dumps(summary), flush=True)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: the parent says it once
        pass
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=os.environ.get("CODA_ADDRESS", "127.0.0.1:50051"),
                        help="the coda-server (default $CODA_ADDRESS or 127.0.0.1:50051)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--recipe", choices=("shares", "scatter"), default="shares")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--token-budget", type=int, default=None,
                        help="--recipe shares: global mini-batches cut by this many response tokens instead of "
                             "trainer.mini_batch_size trajectories")
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.steps < 1:
        parser.error(f"--world-size and --steps must be at least 1, got {args.world_size} and {args.steps}")
    if args.token_budget is not None and args.recipe != "shares":
        parser.error("--token-budget goes with --recipe shares (the scatter recipe cuts by trajectories)")
    if args.token_budget is not None and args.token_budget < 1:
        parser.error(f"--token-budget must be a positive number of tokens, got {args.token_budget}")
    try:
        with PacerClient(args.address, timeout=10) as pacer:  # an unreachable server is said here, before any rank
            state = pacer.state()
    except PacerClientError as error:
        parser.exit(1, f"{parser.prog}: {error}\n")
    if state.job_ended:  # this example ends the job it runs: a second run needs a server of its own
        parser.exit(1, f"the pacer at {args.address} has ended its job (EndJob, e.g. by an earlier run of this "
                       f"example): start a fresh coda-server, or one on another server.state_dir\n")
    groups = state.mini_batch_size // state.group_sizes[0]  # groups of a global mini-batch, each whole on one rank
    world_size = int(os.environ.get("WORLD_SIZE", args.world_size))
    if args.recipe == "shares" and args.token_budget is None and (world_size > groups or groups % world_size):
        parser.error(f"world size {world_size} must divide the {groups} groups of a global mini-batch "
                     f"(trainer.mini_batch_size {state.mini_batch_size} / N {state.group_sizes[0]}): each rank gets "
                     f"the same number of whole groups (the scatter recipe splits them on rank 0 instead)")
    if "RANK" in os.environ:  # launched by torchrun: this process is one rank, the group is in the environment
        dist.init_process_group("gloo")
        try:
            summary = run_rank(dist.get_rank(), dist.get_world_size(), args)
            if summary is not None:
                print(json.dumps(summary), flush=True)
        finally:
            dist.destroy_process_group()
        return 0
    try:
        torch.multiprocessing.spawn(rank_entry, args=(args.world_size, free_port(), args), nprocs=args.world_size)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C would only interrupt the exit's clean-up
        print(f"{parser.prog}: interrupted; the groups the ranks held go back to the buffer when their leases end "
              f"(`coda-client --address {args.address} state` shows them)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
