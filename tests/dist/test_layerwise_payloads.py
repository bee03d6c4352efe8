"""A hostile or misconfigured previous stage over a real gloo link: every bad message is refused, none is applied.

Rank 0 plays the previous stage and sends crafted headers and payloads; rank 1 receives them through
:class:`~lightning_hetero.layerwise.decoupled.ActivationLink` (and, last, through the asynchronous
:class:`~lightning_hetero.layerwise.dgl_runtime.DecoupledRuntime` with ``on_bad_payload="drop"``). A refused header is
sent alone: the receiver never posts the payload of a header it refused, so a crafted payload would stay unmatched.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_hetero import comm
from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.layerwise.decoupled import HEADER_LENGTH, ActivationLink
from lightning_hetero.layerwise.dgl_runtime import DecoupledRuntime
from lightning_hetero.layerwise.settings import LayerwiseSettings
from lightning_hetero.testing import run_distributed

BATCH, SEQ, HIDDEN = 4, 12, 32
SIGNATURE = ("batch",)
_CPU = torch.device("cpu")


def _header(*values: int) -> torch.Tensor:
    return torch.tensor(list(values) + [-1] * (HEADER_LENGTH - len(values)), dtype=torch.int64)


# tag of the scenario -> header rank 0 sends alone (fp32 link; the receiver expects BATCH x (SEQ, HIDDEN))
_BAD_HEADERS = {
    100: _header(0, BATCH, 0, 2, 10**6, 10**6),  # a huge size: must not be allocated
    110: _header(0, BATCH, 0, 2, SEQ, HIDDEN - 1),  # another width: the payload length would not match
    120: _header(0, BATCH, 1, 2, SEQ, HIDDEN),  # a bf16 sender: another wire dtype
    130: _header(0, BATCH + 1, 0, 2, SEQ, HIDDEN),  # another batch
}


def _caught(fn: Any) -> str:
    try:
        fn()
    except PeerPayloadError as error:
        return f"PeerPayloadError(peer={error.peer}): {error}"
    except Exception as error:  # reported, so that the test names what was raised instead
        return f"{type(error).__name__}: {error}"
    return "accepted"


def _activations(poison: bool) -> torch.Tensor:
    values = torch.randn(BATCH, SEQ, HIDDEN)
    if poison:
        values[1, 2, 3] = float("nan")
    return values


def _expect(step: int) -> tuple[int, tuple[int, ...]]:
    return BATCH, (SEQ, HIDDEN)


def _link_scenarios(rank: int, out: dict[str, Any]) -> None:
    for tag, header in _BAD_HEADERS.items():
        if rank == 0:
            comm.send(header, 1, label=comm.PIPELINE, tag=tag + 1)
        else:
            link = ActivationLink(0, tag=tag)
            out[f"header{tag}"] = _caught(
                lambda link=link: link.receive(BATCH, SIGNATURE, _CPU, torch.float32, (SEQ, HIDDEN))
            )
    if rank == 0:  # the unchecked bound, without any local expectation
        comm.send(_BAD_HEADERS[100], 1, label=comm.PIPELINE, tag=141)
    else:
        link = ActivationLink(0, tag=140)
        out["unbounded"] = _caught(lambda: link.receive(BATCH, SIGNATURE, _CPU, torch.float32))
    if rank == 0:  # NaN activations, sent by an honest link
        sender = ActivationLink(1, tag=150)
        sender.send(_activations(poison=True), 0, SIGNATURE)
        sender.flush_sends()
    else:
        link = ActivationLink(0, tag=150)
        out["nan"] = _caught(lambda: link.receive(BATCH, SIGNATURE, _CPU, torch.float32, (SEQ, HIDDEN)))
    for tag, policy in ((160, "raise"), (170, "drop")):
        if rank == 0:  # steps 0, 1 (NaN), 2 on an asynchronous link
            sender = ActivationLink(1, tag=tag, asynchronous=True)
            for step in range(3):
                sender.send(_activations(poison=step == 1), step, SIGNATURE)
            sender.flush_sends()
        else:
            link = ActivationLink(0, tag=tag, asynchronous=True, on_bad_payload=policy)
            received: list[int] = []
            out[f"async_{policy}"] = _caught(
                lambda link=link, received=received: received.extend(
                    step for step, _ in link.drain_until(3, _CPU, torch.float32, _expect)
                )
            )
            out[f"async_{policy}_steps"] = received
            out[f"async_{policy}_dropped"] = link.dropped_payloads
            if policy == "raise":  # the third message is still on its way: take it, so that nothing is left posted
                link.drain_until(3, _CPU, torch.float32, _expect)


def _stale_header_scenario(rank: int, out: dict[str, Any]) -> None:
    """An asynchronous message for a step whose batch the receiver no longer keeps announces twice its width.

    Its size used to be bounded only by 2**30 elements; the receiver now bounds it by its own layout (the batch it is
    on). The payload is sent anyway: a receiver that refused the header takes it off the wire itself, plainly.
    """
    forged = (BATCH, SEQ, 2 * HIDDEN)
    if rank == 0:
        comm.send(_header(3, BATCH, 0, 2, SEQ, 2 * HIDDEN), 1, label=comm.PIPELINE, tag=191)
        work = comm.isend(torch.zeros(forged), 1, label=comm.PIPELINE, tag=190)
        work.wait()
        return
    link = ActivationLink(0, tag=190, asynchronous=True)
    link.messages_received = 5  # a resumed link: message 5 may carry steps 0..5

    def stale(step: int) -> tuple[int, tuple[int, ...]] | None:  # only this stage's current batch is kept
        return (BATCH, (SEQ, HIDDEN)) if step == 5 else None

    out["stale"] = _caught(lambda: link.drain_until(6, _CPU, torch.float32, stale))
    out["stale_field"] = link.last_error.field if link.last_error is not None else None
    if out["stale"].startswith("PeerPayloadError"):
        comm.recv(torch.empty(forged), 0, label=comm.PIPELINE, tag=190)


def _llama_holder() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    holder = torch.nn.Module()
    holder.model = LlamaForCausalLM(config)
    return holder


def _runtime_scenario(rank: int, out: dict[str, Any]) -> None:
    """Stage 0's step 1 is poisoned (NaN embeddings); stage 1 drops that message and keeps training on step 0's."""
    runtime = DecoupledRuntime(LayerwiseSettings(mode="async", replay_capacity=3, on_bad_payload="drop"))
    holder = _llama_holder()
    runtime.setup(holder, _CPU, rank)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for step in range(3):
        ids = torch.randint(0, 64, (BATCH, SEQ), generator=generator)
        batch = {"input_ids": ids, "labels": ids}
        if rank == 0 and step == 1:
            saved = runtime.stage.stem.weight.detach().clone()
            runtime.stage.stem.weight.data.fill_(float("nan"))
            runtime.train_step(batch)
            runtime.stage.stem.weight.data.copy_(saved)
        else:
            losses.append(runtime.train_step(batch).item())
        runtime.stage.zero_grad()
    runtime.flush()
    out["runtime_losses"] = losses
    out["runtime_dropped"] = runtime._links["in10"].dropped_payloads if rank == 1 else 0
    out["runtime_last_used"] = runtime.buffer.stats()


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _link_scenarios(rank, out)
    _stale_header_scenario(rank, out)
    _runtime_scenario(rank, out)
    return out


def test_bad_activation_messages_are_refused_or_dropped_over_gloo() -> None:
    _, received = run_distributed(_worker, 2, timeout=400)
    assert received["header100"].startswith("PeerPayloadError(peer=0)"), received["header100"]
    assert "sample shape (1000000, 1000000)" in received["header100"]
    assert "announce a sample shape (12, 31), but this stage's block expects (12, 32)" in received["header110"]
    assert "encoded as 'bf16', but this stage decodes 'fp32'" in received["header120"]
    assert "announce a batch of 5 samples, this stage read 4" in received["header130"]
    assert "above the" in received["unbounded"] and received["unbounded"].startswith("PeerPayloadError")
    assert "activations from rank 0 holds non-finite values" in received["nan"]
    assert "holds non-finite values" in received["async_raise"] and received["async_raise_steps"] == []
    assert received["async_drop"] == "accepted"
    assert received["async_drop_steps"] == [0, 2] and received["async_drop_dropped"] == 1
    assert received["stale"].startswith("PeerPayloadError(peer=0)"), received["stale"]
    assert (
        "header.sample[1] = 64 is outside [1, 32]" in received["stale"]
        and received["stale_field"] == "header.sample[1]"
    )
    assert received["runtime_dropped"] == 1
    assert len(received["runtime_losses"]) == 3 and all(torch.isfinite(torch.tensor(received["runtime_losses"])))
