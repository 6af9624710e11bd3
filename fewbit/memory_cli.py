"""The ``fewbit memory`` command: saved-for-backward memory of a Hugging Face model.

Builds the model from its transformers *config class defaults* (random weights; nothing is
downloaded, the hub is never contacted), runs one training step for the three variants of
:func:`fewbit.memory.compare` and prints a table in MiB (or ``--json``). Progress goes to
stderr (tqdm). The model is built once and each variant gets a deep copy of it, with the
random-number state the fresh build would have left: the same weights, dropout masks and
counts as three separate builds, without paying for three initialisations.

This module imports only click and the standard library at import time; torch,
transformers and fewbit.memory are imported inside the command.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import click

__all__ = ["memory", "MODELS"]


@dataclass(frozen=True)
class _Spec:
    config: str  # transformers config class
    model: str  # transformers model class (with a head that computes a loss from labels)
    kind: str  # "causal" | "masked" | "seq2seq" | "image"
    intermediate: str | None  # config attribute of the MLP width (None: derived from hidden)
    intermediate_factor: float = 4.0


#: Supported ``--model`` names.
MODELS: dict[str, _Spec] = {
    "gpt2": _Spec("GPT2Config", "GPT2LMHeadModel", "causal", "n_inner"),
    "bert": _Spec("BertConfig", "BertForMaskedLM", "masked", "intermediate_size"),
    "roberta": _Spec("RobertaConfig", "RobertaForMaskedLM", "masked", "intermediate_size"),
    "vit": _Spec("ViTConfig", "ViTForImageClassification", "image", "intermediate_size"),
    "distilbert": _Spec("DistilBertConfig", "DistilBertForMaskedLM", "masked", "hidden_dim"),
    "t5": _Spec("T5Config", "T5ForConditionalGeneration", "seq2seq", "d_ff"),
    "opt": _Spec("OPTConfig", "OPTForCausalLM", "causal", "ffn_dim"),
    "llama": _Spec("LlamaConfig", "LlamaForCausalLM", "causal", "intermediate_size", 8 / 3),
    "phi3": _Spec("Phi3Config", "Phi3ForCausalLM", "causal", "intermediate_size", 8 / 3),
    "bloom": _Spec("BloomConfig", "BloomForCausalLM", "causal", None),
}

_MIB = 2.0**20
_GIB = 2.0**30


class OutputFile(click.Path):
    """A file to write: ``click.Path(dir_okay=False)`` that also refuses a path written as
    a directory (``x.json/``, ``x.json/.``, ``""``), which ``pathlib`` would silently turn
    into ``x.json`` (or ``.``)."""

    def __init__(self):
        super().__init__(dir_okay=False, path_type=Path)

    def convert(self, value, param, ctx):
        if isinstance(value, str):
            if value.endswith(tuple(filter(None, (os.sep, os.altsep)))):
                self.fail(f"{value!r} ends with a path separator: give a file name", param, ctx)
            if os.path.basename(value) in ("", ".", ".."):  # "", "x.json/." name a directory
                self.fail(f"{value!r} names a directory: give a file name", param, ctx)
        return super().convert(value, param, ctx)


def _fail(msg: str) -> None:
    raise click.ClickException(msg)


def _model_setup(key: str, layers: int | None, hidden: int | None, seq_len: int, device: str):
    """The checks and the config shared by ``fewbit memory`` and ``fewbit plan``:
    ``(torch device, spec, config, tokens per example, model class)``; a bad ``--device``
    or a ``--seq-len`` above the model's positions is a one-line error."""
    from fewbit._checks import check_device

    try:
        dev = check_device(device)
    except ValueError as e:
        _fail(str(e))
    if key in ("llama", "phi3") and hidden is not None and hidden % 2:
        _fail(f"--hidden must be even for {key} (its rotary positions need an even head size), got {hidden}")

    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    spec = MODELS[key]
    cfg = _make_config(key, layers, hidden)
    max_pos = _max_positions(cfg)
    if spec.kind != "image" and max_pos is not None and seq_len > max_pos:
        _fail(f"--seq-len must be <= {max_pos} for {key}, got {seq_len}")
    return dev, spec, cfg, _seq_tokens(cfg, spec.kind, seq_len), getattr(transformers, spec.model)


def _make_config(name: str, layers: int | None, hidden: int | None):
    import transformers

    spec = MODELS[name]
    cfg = getattr(transformers, spec.config)()
    if name == "t5" and getattr(cfg, "decoder_start_token_id", None) is None:
        # T5 starts decoding from the pad token (its pretrained configs say so); a default
        # T5Config of transformers 5 has no decoder_start_token_id, and the labels cannot be
        # shifted into decoder inputs without it
        cfg.decoder_start_token_id = cfg.pad_token_id
    if layers is not None:
        cfg.num_hidden_layers = layers
        if name == "t5":
            cfg.num_decoder_layers = layers
    if hidden is not None:
        heads = max(1, hidden // 64)
        rotary = name in ("llama", "phi3")  # an even head size (rotary positions), found for an even hidden
        while hidden % heads or (rotary and (hidden // heads) % 2 and heads > 1):
            heads -= 1
        cfg.hidden_size = hidden
        cfg.num_attention_heads = heads
        if name == "t5":
            cfg.d_kv = hidden // heads
        if name in ("llama", "phi3"):
            cfg.num_key_value_heads = heads
            cfg.head_dim = hidden // heads
        if name == "opt":
            cfg.word_embed_proj_dim = hidden
        if spec.intermediate is not None:
            setattr(cfg, spec.intermediate, int(round(hidden * spec.intermediate_factor)))
    return cfg


def _max_positions(cfg) -> int | None:
    for attr in ("n_positions", "max_position_embeddings"):
        v = getattr(cfg, attr, None)
        if isinstance(v, int):
            # RoBERTa reserves padding_idx + 1 positions.
            return v - 2 if cfg.model_type == "roberta" else v
    return None


def _seq_tokens(cfg, kind: str, seq_len: int) -> int:
    if kind == "image":
        return (cfg.image_size // cfg.patch_size) ** 2 + 1
    return seq_len


def _count_parameters(key: str, cfg, model_cls) -> int:
    """Parameters of ``model_cls(cfg)``, counted on meta models of one and two layers and
    extrapolated (the count is affine in the number of layers), so that a huge ``--layers``
    is refused at once instead of building its meta model first."""
    import torch

    layers = int(cfg.num_hidden_layers)
    counts = []
    for n in (1, 2) if layers > 2 else (layers,):
        c = copy.deepcopy(cfg)
        c.num_hidden_layers = n
        if key == "t5":
            c.num_decoder_layers = n
        with torch.device("meta"):
            counts.append(sum(p.numel() for p in model_cls(c).parameters()))
    return counts[0] if len(counts) == 1 else counts[0] + (layers - 1) * (counts[1] - counts[0])


def _check_fits(key: str, cfg, model_cls, batch: int, seq: int, device: str) -> int:
    """The model's parameter count; a one-line error if one training step would need
    more than 80% of the device's free memory (:func:`_estimate_bytes`)."""
    n_params = _count_parameters(key, cfg, model_cls)
    need = _estimate_bytes(key, cfg, n_params, batch, seq)
    avail = _available_bytes(device)
    if avail is not None and need > 0.8 * avail:
        _fail(f"{key} with batch {batch} and {seq} tokens needs about {need / _GIB:.1f} GiB, "
              f"only {avail / _GIB:.1f} GiB available; lower --seq-len/--batch or use --layers/--hidden")
    return n_params


def _estimate_bytes(name: str, cfg, n_params: int, batch: int, seq: int) -> int:
    """Rough upper estimate of one fp32 training step: weights + grads + saved activations.

    Weights count twice: the template built once and the copy being measured.

    Saved activations per layer follow Korthikanti et al. (2022), ``s*b*h*(34 + 5*a*s/h)``
    bytes in 16-bit, doubled for fp32; plus the logits (3 copies) and a 1.5x margin.
    """
    h = int(getattr(cfg, "hidden_size", 768))
    a = int(getattr(cfg, "num_attention_heads", 12))
    layers = int(getattr(cfg, "num_hidden_layers", 12))
    if name == "t5":
        layers *= 2
    vocab = int(getattr(cfg, "vocab_size", None) or getattr(cfg, "num_labels", 2))
    act = layers * batch * seq * h * (34 + 5 * a * seq / h) * 2
    logits = 3 * batch * seq * vocab * 4
    return int(1.5 * (12 * n_params + act + logits))


def _available_bytes(device: str) -> int | None:
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _inputs(name: str, cfg, batch: int, seq: int, device):
    import torch

    g = torch.Generator().manual_seed(0)
    spec = MODELS[name]
    if spec.kind == "image":
        x = torch.randn(batch, cfg.num_channels, cfg.image_size, cfg.image_size, generator=g)
        y = torch.randint(0, cfg.num_labels, (batch,), generator=g)
        return {"pixel_values": x.to(device), "labels": y.to(device)}
    ids = torch.randint(3, cfg.vocab_size, (batch, seq), generator=g).to(device)
    return {"input_ids": ids, "labels": ids.clone()}


def _format_table(title: str, res: dict) -> str:
    head = (f"{'variant':<14}{'saved MiB':>11}{'activations':>13}{'compressed':>12}{'other':>10}"
            f"{'saved ratio':>13}{'act ratio':>11}")
    lines = [title, head, "-" * len(head)]
    for variant, d in res.items():
        sr = "-" if d.get("saved_ratio") is None else f"{d['saved_ratio']:.2f}x"
        ar = "-" if d.get("activation_ratio") is None else f"{d['activation_ratio']:.2f}x"
        lines.append(
            f"{variant:<14}{d['saved_bytes'] / _MIB:>11.2f}{d['activation_bytes'] / _MIB:>13.2f}"
            f"{d['compressed_bytes'] / _MIB:>12.2f}{d['other_bytes'] / _MIB:>10.2f}{sr:>13}{ar:>11}"
        )
    peak = [d.get("peak_bytes") for d in res.values()]
    if any(p is not None for p in peak):
        lines.append("peak CUDA MiB: " + ", ".join(
            f"{v} {d['peak_bytes'] / _MIB:.1f}" for v, d in res.items() if d.get("peak_bytes") is not None))
    lines.append("ratios are vanilla / variant; parameters are not counted (held anyway); "
                 "'other' includes what the loss saves (logits)")
    return "\n".join(lines)


class _CopyFactory:
    """Model factory for :func:`fewbit.memory.compare` that builds the model only once.

    ``compare`` seeds torch with 0 and calls the factory once per variant. The first call
    builds the model (the template) and records the CPU random-number state that the build
    left; every call returns a deep copy of the template and restores that state, so
    weights and later random draws (dropout) are exactly those of a fresh build, and every
    variant is measured beside the template alike. Each call also advances the progress
    bar.
    """

    def __init__(self, build, device, bar, stages):
        self._build, self._device, self._bar, self._stages = build, device, bar, stages
        self._template = None
        self._rng = None
        self._calls = 0

    def __call__(self):
        import torch

        if self._template is None:
            self._template = self._build().to(self._device)
            self._template.train()
            self._rng = torch.get_rng_state()
        self._bar.update(1)
        self._calls += 1
        self._bar.set_postfix_str(self._stages[min(self._calls, len(self._stages) - 1)])
        torch.set_rng_state(self._rng)
        # a copy for every variant, the last too: the template held beside each alike, so
        # that their CUDA peaks compare (the last had been measured without it)
        return copy.deepcopy(self._template)


def _format_bits(d: dict) -> str:
    """fewbit+quant's compressed saved tensors by (compressor, bits)
    (:func:`fewbit.memory.format_bits_histogram`)."""
    from fewbit.memory import format_bits_histogram

    return "\n".join(format_bits_histogram(d.get("saved_tensors", []), d.get("average_bits"),
                                           "fewbit+quant saved tensors"))


def _choice(option: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        _fail(f"Invalid value for '{option}': {value!r} is not one of {', '.join(map(repr, allowed))}")
    return value


def _positive(ctx, param, value):
    if value is not None and value < 1:
        raise click.BadParameter(f"must be >= 1, got {value}")
    return value


#: The widest ``--hidden``: a head-size search steps down from ``hidden // 64``, and
#: ``--hidden 99999999999999999999`` spun there without end before any memory check.
MAX_HIDDEN = 65536


def _hidden(ctx, param, value):
    if value is not None and not 1 <= value <= MAX_HIDDEN:
        raise click.BadParameter(f"must be in 1..{MAX_HIDDEN}, got {value}")
    return value


def _layer_bits(ctx, param, values):
    """``("block=4", ...)`` -> ``{"block": 4}`` (None when not given); kinds and bits are
    checked by ``fewbit.Config``."""
    out: dict[str, int | str] = {}
    for v in values:
        kind, sep, bits = v.partition("=")
        if not sep or not kind or not bits:
            _fail(f"Invalid value for '--layer-bits': must be KIND=BITS, e.g. block=4, got {v!r}")
        kind = kind.strip()
        if kind in out:
            _fail(f"Invalid value for '--layer-bits': names kind {kind!r} twice, got {' '.join(values)}")
        try:
            out[kind] = int(bits)
        except ValueError:
            _fail(f"Invalid value for '--layer-bits': BITS must be an integer (1, 2, 4 or 8), got {v!r}")
    return out or None


@click.command("memory")
@click.option("--model", "model_name", required=True, metavar="NAME",
              help=f"Hugging Face architecture: {', '.join(MODELS)}.")
@click.option("--seq-len", default=256, show_default=True, type=int, callback=_positive,
              help="Tokens per example (vision models use their image size instead).")
@click.option("--batch", default=1, show_default=True, type=int, callback=_positive)
@click.option("--bits", default=3, show_default=True, type=int, help="Few-bit code width, 1..8.")
@click.option("--saved-bits", default="4", show_default=True, metavar="BITS",
              help="Width for the other saved tensors: 1, 2, 4, 8, or auto (GACT per-tensor bits "
                   "from gradient sensitivity on the same random batch; needs --average-bits).")
@click.option("--average-bits", default=None, type=float,
              help="With --saved-bits auto: GACT's budget, the average bits per element of the tensors it "
                   "plans, 1..32 (attention's q and k, softmax results and norm inputs keep 8 bits outside "
                   "it, so the report's average is higher).")
@click.option("--compressor", default="group", show_default=True,
              callback=lambda ctx, param, value: _choice("--compressor", value, ("group", "division", "adacc")),
              help="group (ActNN), division (DIVISION) or adacc (Adacc's per-layer compressors).")
@click.option("--group-size", default=256, show_default=True, type=int, callback=_positive)
@click.option("--layer-bits", "layer_bits", multiple=True, metavar="KIND=BITS", callback=_layer_bits,
              help="Other bits for the tensors saved by one layer kind itself (repeatable), e.g. "
                   "--layer-bits block=4 for a LLaMA's gated-MLP product: ActNN's per-layer settings; with "
                   "a --saved-bits of 1, 2, 4 or 8 and the group compressor.")
@click.option("--fused-cross-entropy", is_flag=True,
              help="Causal LMs: fewbit+quant computes the loss with the exact chunked linear + "
                   "cross-entropy, so the logits are not saved.")
@click.option("--layers", default=None, type=int, callback=_positive,
              help="Override the number of layers of the default config.")
@click.option("--hidden", default=None, type=int, callback=_hidden,
              help="Override the hidden size (MLP width and heads follow).")
@click.option("--device", default="cpu", show_default=True, help="torch device (cpu, cuda).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Show a progress bar on stderr.")
def memory(model_name, seq_len, batch, bits, saved_bits, average_bits, compressor, group_size, layer_bits,
           fused_cross_entropy, layers, hidden, device, as_json, progress):
    """Memory saved for backward by one training step of a Hugging Face model.

    The model is built from the default config of its transformers class with random
    weights (no download). Three variants: vanilla; fewbit (activations keep BITS-bit
    codes, Novikov et al. ICML 2023); fewbit+quant (and every other saved tensor is
    group-quantized to SAVED_BITS bits, ActNN-style; or compressed by --compressor; or, with
    --saved-bits auto, at GACT's per-tensor bits averaging --average-bits; with
    --fused-cross-entropy, a causal LM's logits are not saved either; --layer-bits gives
    some layer kinds other bits). The per-tensor bits of fewbit+quant follow the table.
    """
    key = model_name.lower()
    if key not in MODELS:
        _fail(f"unknown model {model_name!r}; supported: {', '.join(MODELS)}")
    if fused_cross_entropy and MODELS[key].kind != "causal":
        causal = ", ".join(k for k, v in MODELS.items() if v.kind == "causal")
        _fail(f"--fused-cross-entropy needs a causal LM ({causal}), got {key}")
    from fewbit._checks import TABLE_BITS  # imports torch
    from fewbit.quant import SUPPORTED_BITS

    if bits not in TABLE_BITS:
        _fail(f"--bits must be in {TABLE_BITS[0]}..{TABLE_BITS[-1]}, got {bits}")
    allowed = ", ".join(map(str, SUPPORTED_BITS))
    if saved_bits != "auto":
        if saved_bits not in {str(b) for b in SUPPORTED_BITS}:
            _fail(f"--saved-bits must be one of {allowed}, got {saved_bits} (or auto, with --average-bits)")
        saved_bits = int(saved_bits)
        if average_bits is not None:
            _fail("--average-bits is only used with --saved-bits auto")
    else:
        if average_bits is None:
            _fail("--saved-bits auto needs --average-bits (1..32)")
        if not 1 <= average_bits <= 32:
            _fail(f"--average-bits must be in 1..32, got {average_bits:g}")
        if compressor != "group":
            _fail(f"--saved-bits auto uses the group quantizer; got --compressor {compressor}")

    import torch

    import fewbit

    try:  # the combination, before any progress bar (e.g. compressor adacc refuses 1 bit)
        fewbit.Config(activation_bits=bits, saved_bits=saved_bits, average_bits=average_bits,
                      compressor=compressor, group_size=group_size, fused_cross_entropy=fused_cross_entropy,
                      layer_bits=layer_bits)
    except ValueError as exc:
        _fail(f"{exc} (--saved-bits, --average-bits, --compressor, --group-size, --layer-bits)")
    dev, spec, cfg, seq, model_cls = _model_setup(key, layers, hidden, seq_len, device)

    from fewbit import memory as fm

    n_params = _check_fits(key, cfg, model_cls, batch, seq, device)

    from tqdm import tqdm

    inputs = _inputs(key, cfg, batch, seq_len, dev)
    stages = ["building the model", *(f"{v}: forward+backward" for v in fm.VARIANTS)]
    bar = tqdm(total=len(stages), desc=f"fewbit memory {key}", unit="step", file=sys.stderr,
               disable=not progress, leave=False, dynamic_ncols=True)
    try:
        bar.set_postfix_str(stages[0])
        res = fm.compare(_CopyFactory(lambda: model_cls(cfg), dev, bar, stages), inputs, bits=bits,
                         saved_bits=saved_bits, group_size=group_size, average_bits=average_bits,
                         compressor=compressor, fused_cross_entropy=fused_cross_entropy,
                         layer_bits=layer_bits)
        bar.update(1)
        bar.refresh()  # update() redraws only after tqdm's mininterval: show the last step
    except (MemoryError, torch.OutOfMemoryError) as exc:
        bar.close()
        _fail(f"out of memory while measuring {key} (batch {batch}, {seq} tokens): "
              f"lower --seq-len/--batch ({type(exc).__name__})")
    except ValueError as exc:  # a compressor this installation does not have, or refuses these bits
        bar.close()
        _fail(str(exc).splitlines()[0])
    except RuntimeError as exc:
        bar.close()
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "memory" in msg.lower() or "allocate" in msg.lower():
            _fail(f"out of memory while measuring {key}: {msg}; lower --seq-len/--batch")
        raise
    bar.close()
    if res["vanilla"]["activation_bytes"] == 0 or res["fewbit"]["converted"] == 0:
        click.echo(f"warning: {key} has no activation module that fewbit supports; "
                   "the fewbit variants only differ by the group quantizer", err=True)
    for kind, n in res.get("fewbit+quant", {}).get("layer_bits_tensors", {}).items():
        if n == 0:
            click.echo(f"warning: --layer-bits {kind}={layer_bits[kind]} changed nothing: no tensor of {key} "
                       f"saved by a {kind!r} layer itself took those bits (the innermost converted module's kind "
                       "decides: a LLaMA block's gated-MLP product is the block's own; norm inputs and softmax "
                       "results get 8 bits whatever the kind)", err=True)
    if as_json:
        click.echo(json.dumps(res, indent=1))
    else:
        title = (f"{key}: {n_params / 1e6:.1f}M parameters, {cfg.num_hidden_layers} layers, "
                 f"batch {batch}, {seq} tokens, bits {bits}, saved-bits {saved_bits}"
                 f"{f' (average {average_bits:g})' if saved_bits == 'auto' else ''}"
                 f"{''.join(f', {k} {b}' for k, b in (layer_bits or {}).items())}, compressor {compressor}, "
                 f"group {group_size}{', fused cross-entropy' if fused_cross_entropy else ''}, device {device}")
        click.echo(_format_table(title, res))
        click.echo(_format_bits(res["fewbit+quant"]))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(memory())
