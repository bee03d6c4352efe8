"""Variant names of ``recipes/flexdemo/bench_flexdemo.py``: one string per run, parsed into the worker's strategy
arguments.

Grammar (tokens joined by ``-``, an optional ``@<learning rate>`` at the end)::

    variant  := base ["@" LR]                       e.g. demo-1/32-sign-c128@3e-4
    base     := ("ddp" | "hsdp") ["-b" X]           stock Lightning baselines
              | REPLICATOR ("-" option)*            FlexDeMoStrategy with that replicator
    option   := "1/" N        fraction of coefficients kept (kept_fraction 1/N; diloco: default H = N)
              | VALUES        fp32, bf16, sign or ternary (the wire encoding of the kept values)
              | "c" N         DCT block / top-k chunk side (demo, topk)
              | "noef"        error feedback off: what is not sent is dropped (demo, topk, random, striding)
              | "sgd"         the module's optimizer is SGD, so FlexDeMo runs DeMoSGD (the DeMo paper's optimizer:
                              momentum 0.999 of the raw gradients, DCT top-k of it sent, sign update) instead of
                              DecoupledAdamW
              | "xgrad"       the converted DecoupledAdamW exchanges the raw gradient (error feedback on it) and runs
                              Adam on the combined gradient (``FlexDeMoSettings.adamw_exchange="gradient"``)
              | "xpre"        the converted DecoupledAdamW exchanges the gradient preconditioned by local Adam's
                              second moment, its error-feedback buffer being the first moment
                              (``FlexDeMoSettings.adamw_exchange="preconditioned"``, the strategy's default). Without
                              xgrad/xpre a variant runs 0.1's exchange, ``"direction"`` (local Adam's direction), so
                              recorded runs keep their meaning
              | "b" X         AdamW's beta2 of the module (default 0.95), e.g. b0.999; the only option the stock
                              baselines take (ddp-b0.999@3e-3), so both sides are tuned over it alike. Under xpre it
                              is the decay of the second moment that preconditions what is exchanged
              | "h" N         DiLoCo local steps between syncs (diloco)
              | "olr" X       DiLoCo outer learning rate (diloco)
              | "om" X        DiLoCo outer Nesterov momentum (diloco)
              | "demo1/" N    DeMo + DiLoCo: each sync sends 1/N of the delta's DCT coefficients (diloco; its "c" N
                              then sets that DCT's block side)

``REPLICATOR`` is one of demo, random, topk, striding, diloco, full. The old names (``demo-1/32-bf16``, ``diloco``,
``random-1/64-sign@1e-3``) parse to exactly the arguments they always had. DeMo and DiLoCo together are one
replicator, DiLoCo with a DCT top-k delta: ``diloco-h8-demo1/32-bf16`` (every 8 steps, 1/32 of the delta's DCT
coefficients in bf16, error feedback across periods).

Unknown or misplaced tokens raise a ``ValueError`` naming the token and the fix, before any run starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

BASELINES = ("hsdp", "ddp")
REPLICATORS = ("demo", "random", "topk", "striding", "diloco", "full")
VALUES = ("fp32", "bf16", "sign", "ternary")
#: Which options each replicator takes (the fraction and the values apply to all but ``full``'s fraction).
CHUNKED = ("demo", "topk")
WITH_ERROR_FEEDBACK = ("demo", "topk", "random", "striding")
GRAMMAR_HELP = (
    "a variant is ddp[-b<beta2>], hsdp[-b<beta2>] or <replicator>[-1/N][-<values>][-c<chunk>][-noef]"
    "[-sgd|-xgrad|-xpre][-b<beta2>][-h<H>]"
    "[-olr<x>][-om<x>][-demo1/N][@<lr>]"
    f" with replicator in {list(REPLICATORS)} and values in {list(VALUES)}; c: demo/topk (and diloco with demo1/N),"
    f" noef: {'/'.join(WITH_ERROR_FEEDBACK)} only, h/olr/om/demo1/N: diloco only (e.g. demo-1/32-sign-c128@3e-4,"
    " diloco-h16-olr0.7, diloco-h8-demo1/32-bf16)"
)

_EXCHANGE_TOKENS = {"xgrad": "gradient", "xpre": "preconditioned"}  # FlexDeMoSettings.adamw_exchange
_FRACTION = re.compile(r"1/(\d+)")
_OUTER_FRACTION = re.compile(r"demo1/(\d+)")
_INTEGER_OPTION = re.compile(r"(c|h)(\d+)")
_BETA2 = re.compile(r"b(0?\.\d+)")
_FLOAT_OPTION = re.compile(r"(olr|om)(\d*\.?\d+(?:e-?\d+)?)")


@dataclass(frozen=True)
class Variant:
    """One benchmark run's strategy configuration, parsed from its name."""

    name: str
    strategy: str  # "ddp", "hsdp" or "flexdemo"
    learning_rate: float | None = None
    replicator: str | None = None
    kept_fraction: float | None = None
    values: str | None = None
    chunk: int | None = None
    error_feedback: bool = True
    optimizer: str = "adamw"
    adamw_exchange: str = "direction"
    sync_every: int | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    outer_kept_fraction: float | None = None
    beta2: float | None = None

    @property
    def speed_key(self) -> str:
        """The name without ``@lr``: step time and bytes do not depend on the learning rate."""
        return self.name.partition("@")[0]

    @property
    def baseline(self) -> bool:
        """A stock Lightning baseline (``ddp`` or ``hsdp``)."""
        return self.strategy in BASELINES

    @property
    def periodic(self) -> bool:
        """Communicates only on some steps (DiLoCo): step time and bytes must be averaged over a whole period."""
        return self.replicator == "diloco"

    @property
    def period(self) -> int:
        """Steps between synchronisations (1 for every-step exchanges)."""
        if not self.periodic:
            return 1
        return self.sync_every or max(1, round(1 / (self.kept_fraction or 1 / 32)))

    def replicator_options(self) -> dict[str, Any]:
        """``build_replicator`` options set by the name (None: the replicator's default)."""
        chunk = "outer_chunk" if self.periodic else "chunk"  # DeMo + DiLoCo: the block side of the delta's DCT
        options = {"values": self.values, chunk: self.chunk, "sync_every": self.sync_every}
        options |= {"outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum}
        options |= {"outer_kept_fraction": self.outer_kept_fraction}
        return {key: value for key, value in options.items() if value is not None}

    def replication_settings(self) -> Any:
        """The strategy's :class:`~lightning_hetero.replication.ReplicationSettings` of this FlexDeMo variant."""
        from lightning_hetero.replication import ReplicationSettings

        if self.baseline:
            raise ValueError(f"variant {self.name!r} is a stock baseline and has no replicator")
        fields: dict[str, Any] = {"kind": self.replicator, "values": self.values}
        if self.periodic:  # DiLoCo: its period (h<H>, or 1/N meaning H = N) and DeMo + DiLoCo's delta compression
            fields |= {"sync_every": self.period, "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum}
            fields |= {"outer_kept_fraction": self.outer_kept_fraction, "outer_chunk": self.chunk}
        elif self.replicator != "full":
            fields |= {"kept_fraction": self.kept_fraction, "chunk": self.chunk}
        return ReplicationSettings(**{key: value for key, value in fields.items() if value is not None})

    def worker_args(self) -> list[str]:
        """The ``recipes/flexdemo/bench_worker.py`` arguments of this variant."""
        if self.baseline:
            args = ["--strategy", self.strategy]
        else:
            args = ["--strategy", "flexdemo", "--replicator", str(self.replicator)]
            args += ["--kept-fraction", str(self.kept_fraction)]
            for option, flag in (("values", "--values"), ("chunk", "--chunk"), ("sync_every", "--sync-every")):
                if getattr(self, option) is not None:
                    args += [flag, str(getattr(self, option))]
            outer = (("outer_lr", "--outer-lr"), ("outer_momentum", "--outer-momentum"))
            for option, flag in (*outer, ("outer_kept_fraction", "--outer-kept-fraction")):
                if getattr(self, option) is not None:
                    args += [flag, str(getattr(self, option))]
            if not self.error_feedback:
                args.append("--no-error-feedback")
            if self.optimizer != "adamw":
                args += ["--optimizer", self.optimizer]
            if self.adamw_exchange != "direction":
                args += ["--adamw-exchange", self.adamw_exchange]
        if self.learning_rate is not None:
            args += ["--learning-rate", str(self.learning_rate)]
        if self.beta2 is not None:
            args += ["--beta2", str(self.beta2)]
        return args


def parse_variant(name: str) -> Variant:
    """Parse a variant name (see the module docstring); raise ``ValueError`` naming the bad token and the fix."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"--variants: empty variant name; {GRAMMAR_HELP}")
    base, at, rate = name.partition("@")
    learning_rate = None
    if at:
        try:
            learning_rate = float(rate)
        except ValueError:
            raise ValueError(f"variant {name!r}: the part after '@' must be a learning rate such as 1e-3") from None
        if not learning_rate > 0:
            raise ValueError(f"variant {name!r}: the learning rate after '@' must be > 0")
    if "+" in base:
        raise ValueError(
            f"variant {name!r}: write DeMo + DiLoCo as one DiLoCo variant with a DCT top-k delta, e.g."
            f" diloco-h8-demo1/32-bf16; {GRAMMAR_HELP}"
        )
    replicator, *tokens = base.split("-")
    if replicator in BASELINES:
        if len(tokens) > 1 or (tokens and not _BETA2.fullmatch(tokens[0])):
            raise ValueError(
                f"variant {name!r}: the stock baseline {replicator!r} takes only AdamW's beta2 (-b<beta2>, e.g."
                f" {replicator}-b0.999) and '@<lr>'"
            )
        beta2 = _parse_beta2(name, tokens[0]) if tokens else None
        return Variant(name=name, strategy=replicator, learning_rate=learning_rate, beta2=beta2)
    if replicator not in REPLICATORS:
        raise ValueError(f"variant {name!r}: unknown strategy or replicator {replicator!r}; {GRAMMAR_HELP}")
    fields: dict[str, Any] = {}

    def put(field: str, value: Any, token: str) -> None:
        if field in fields:
            raise ValueError(f"variant {name!r}: {field} given twice (token {token!r}); give each option once")
        fields[field] = value

    for token in tokens:
        if match := _FRACTION.fullmatch(token):
            denominator = int(match.group(1))
            if denominator < 1:
                raise ValueError(f"variant {name!r}: fraction {token!r} must be 1/N with N >= 1")
            put("kept_fraction", 1 / denominator, token)
        elif token in VALUES:
            put("values", token, token)
        elif token == "sgd":
            put("optimizer", "sgd", token)
        elif token in _EXCHANGE_TOKENS:
            put("adamw_exchange", _EXCHANGE_TOKENS[token], token)
        elif token == "noef":
            _only(name, token, replicator, WITH_ERROR_FEEDBACK, "error feedback off")
            put("error_feedback", False, token)
        elif match := _INTEGER_OPTION.fullmatch(token):
            option, number = match.group(1), int(match.group(2))
            if option == "c":
                _only(name, token, replicator, (*CHUNKED, "diloco"), "the chunk size")
                put("chunk", number, token)
            else:
                _only(name, token, replicator, ("diloco",), "H (local steps per sync)")
                put("sync_every", number, token)
        elif _BETA2.fullmatch(token):
            put("beta2", _parse_beta2(name, token), token)
        elif match := _FLOAT_OPTION.fullmatch(token):
            _only(name, token, replicator, ("diloco",), "the outer learning rate / momentum")
            put("outer_lr" if match.group(1) == "olr" else "outer_momentum", float(match.group(2)), token)
        elif match := _OUTER_FRACTION.fullmatch(token):
            _only(name, token, replicator, ("diloco",), "DeMo + DiLoCo's delta fraction")
            if int(match.group(1)) < 1:
                raise ValueError(f"variant {name!r}: {token!r} must be demo1/N with N >= 1")
            put("outer_kept_fraction", 1 / int(match.group(1)), token)
        elif token in REPLICATORS:
            raise ValueError(
                f"variant {name!r}: {replicator} and {token} cannot be combined (an optimizer holds one replicator);"
                " DeMo + DiLoCo is diloco-h<H>-demo1/<N>, other pairs run as separate variants"
            )
        else:
            raise ValueError(f"variant {name!r}: unknown option {token!r}; {GRAMMAR_HELP}")
    if replicator == "diloco" and "chunk" in fields and "outer_kept_fraction" not in fields:
        raise ValueError(f"variant {name!r}: DiLoCo takes c<chunk> only with demo1/N (the DCT of its delta)")
    if replicator == "diloco" and "sync_every" in fields and "kept_fraction" in fields:
        raise ValueError(f"variant {name!r}: give DiLoCo's period once, as h<H> or as 1/N (which means H = N)")
    if fields.get("optimizer") == "sgd" and "adamw_exchange" in fields:
        raise ValueError(f"variant {name!r}: xgrad/xpre set how AdamW is exchanged; drop it or sgd (DeMoSGD)")
    if replicator == "full" and "kept_fraction" in fields:
        raise ValueError(f"variant {name!r}: 'full' sends everything; drop the fraction (use values to compress)")
    fields.setdefault("kept_fraction", 1 / 32)
    return Variant(name=name, strategy="flexdemo", learning_rate=learning_rate, replicator=replicator, **fields)


def _parse_beta2(name: str, token: str) -> float:
    beta2 = float(token[1:])
    if not 0.0 < beta2 < 1.0:
        raise ValueError(f"variant {name!r}: AdamW's beta2 {token!r} must lie in (0, 1), e.g. b0.999")
    return beta2


def _only(name: str, token: str, replicator: str, allowed: tuple[str, ...], what: str) -> None:
    if replicator not in allowed:
        raise ValueError(f"variant {name!r}: {token!r} sets {what}, which only {'/'.join(allowed)} take")


def validate_variant(name: str) -> Variant:
    """Parse ``name`` and build its replicator once, so range errors (chunk > 256, H < 1, ...) fail before any run."""
    variant = parse_variant(name)
    if not variant.baseline:
        try:
            build_variant_replicator(variant)
        except ValueError as error:
            raise ValueError(f"variant {name!r}: {error}") from None
    return variant


def build_variant_replicator(variant: Variant) -> Any:
    """A fresh replicator for a FlexDeMo variant; with ``noef``, one that drops what it does not send.

    Compressing replicators subtract what they sent from the optimizer's buffer in place (error feedback). The
    ``noef`` class zeroes that buffer after each encode, so nothing is left for later steps. With ``DecoupledAdamW``
    (the benchmark's optimizer) the buffer is the error-feedback accumulator ``e``: each step then sends the top-k of
    that step's Adam direction alone. (With ``DeMoSGD`` the buffer is the momentum, which this would also drop.)
    """
    from lightning_hetero.replication import REPLICATORS, build_replicator

    if variant.baseline:
        raise ValueError(f"variant {variant.name!r} is a stock baseline and has no replicator")
    kept_fraction = float(variant.kept_fraction or 1 / 32)
    if variant.error_feedback:
        return build_replicator(str(variant.replicator), kept_fraction, **variant.replicator_options())
    base = REPLICATORS[str(variant.replicator)]

    class NoErrorFeedback(base):  # type: ignore[misc, valid-type]
        def encode(self, key: int, source: Any) -> Any:
            piece = super().encode(key, source)
            source.zero_()  # drop the unsent remainder (and the quantisation error) of this step
            return piece

    NoErrorFeedback.__name__ = NoErrorFeedback.__qualname__ = f"NoErrorFeedback{base.__name__}"
    return NoErrorFeedback(kept_fraction, **variant.replicator_options())
