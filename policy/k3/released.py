"""Released Kimi K3 checkpoints <-> our K3ForCausalLM: tensor names and layouts, config.json.

The released K3 text decoder is Moonshot's `KimiLinearForCausalLM` (model_type "kimi_linear",
k3-architecture.md sections 0-1). Our parameter names already follow it almost everywhere
(`model.layers.{i}.self_attn.*` for KDA and MLA alike, `input_layernorm`, the dense layer-0
`mlp.{gate,up,down}_proj`, `model.norm`, `lm_head`). What differs, in the one table below:

    ours                                            released
    model.layers.{i}.mlp.*           (sparse i)     model.layers.{i}.block_sparse_moe.*
    ...mlp.experts.gate_up_proj      [E, 2F, L]     ...block_sparse_moe.experts.{j}.w1.weight [F, L]
                                                    ...block_sparse_moe.experts.{j}.w3.weight [F, L]
    ...mlp.experts.down_proj         [E, L, F]      ...block_sparse_moe.experts.{j}.w2.weight [L, F]
    model.layers.{i}.{site}.proj.weight [1, D]      model.layers.{i}.{site}_proj.weight
    model.layers.{i}.{site}.norm.weight [D]         model.layers.{i}.{site}_norm.weight
        site = self_attention_res | mlp_res;  model-level output_attn_res the same way
    model.layers.{i}.self_attn.A_log [H]            same name, [P] zero-padded, P = 128 (H <= 128)

w1 = gate (first F rows of our fused gate_up), w3 = up, w2 = down; all in nn.Linear's
[out, in] layout, so nothing is transposed. Layer indices are 0-based in tensor names (only
the config's layer lists are 1-based). With tie_word_embeddings the released checkpoint
carries no `lm_head.weight`.

Evidence and uncertain entries ([U]): the names come from Moonshot's `modeling_kimi_linear.py`
as read through several consistent third-party ports, transformers 5.24's kimi_linear
conversion mapping (which renames exactly `block_sparse_moe`, the per-expert w1/w2/w3 and the
separate q/k/v conv weights of Kimi-Linear-48B) and a header audit of the release quoted by one
port. [U] A_log: that audit reports F32[128] for 96 heads with the tail exactly zero; how the
padding generalises to other head counts (here: up to a multiple of 128) is a guess. On load
A_log is also accepted as [H] (K3's modeling code) and [1, 1, H, 1] (Kimi-Linear-48B, what
transformers expects); any nonzero padding is an error. [U] The vision-language release puts
the decoder under `language_model.` next to `vision_tower.*` / `mm_projector.*`; those two
prefixes are skipped (and only those). Not supported: MXFP4-packed routed experts
(`weight_packed` / `weight_scale`, the release's format) - dequantize them to `.weight` first.

Strictness: every released tensor maps to exactly one of ours and back; missing, unexpected
and misshapen tensors raise ReleasedCheckpointError naming (the first few of) them.
The config.json side (`config_from_released`, `config_to_released`) lives in released_config.py.

Letters: E experts, F expert intermediate size, L expert width (latent or hidden size),
D hidden size, H KDA heads, P padded A_log length.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
from torch import Tensor

from policy.k3.configuration import K3Config
from policy.k3.modeling import K3ForCausalLM
from policy.k3.released_config import config_from_released, config_to_released

# --- the name map: every difference between our names and the released ones ----------------
ATTN_RES_SITES = ("self_attention_res", "mlp_res", "output_attn_res")
SPARSE_MLP = ("mlp", "block_sparse_moe")  # (ours, released) module name of MoE layers
EXPERT_WEIGHTS = MappingProxyType({"gate": "w1", "up": "w3", "down": "w2"})
A_LOG_PAD = 128  # [U] released A_log length is padded up to a multiple of this
VL_TEXT_PREFIX = "language_model."  # [U] the decoder's prefix in the vision-language release
VL_SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")  # [U] not text-decoder tensors
_ATTN_RES = re.compile(rf"^(model\.(?:layers\.\d+\.)?)({'|'.join(ATTN_RES_SITES)})\.(proj|norm)\.")
_SPARSE = re.compile(rf"^model\.layers\.(\d+)\.{SPARSE_MLP[0]}\.")
_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
_SHOWN = 5  # names listed per kind of problem in an error


class ReleasedCheckpointError(ValueError):
    """The tensors do not form the released checkpoint of this config (nothing was loaded)."""


def released_name(ours: str, config: K3Config) -> str:
    """Our parameter name -> its released name (experts: the module prefix only)."""
    name = _ATTN_RES.sub(r"\1\2_\3.", ours)
    match = _SPARSE.match(name)
    if match and config.mlp_types[int(match.group(1))] == "sparse":
        name = f"model.layers.{match.group(1)}.{SPARSE_MLP[1]}.{name[match.end() :]}"
    return name


@dataclass(frozen=True)
class PlanEntry:
    """One of our tensors and the released tensors it is made of."""

    ours: str
    shape: tuple[int, ...]  # our shape
    kind: str  # "plain" | "gate_up" | "down" | "a_log"
    released: tuple[str, ...]
    released_shapes: tuple[tuple[int, ...], ...]


def _padded(heads: int) -> int:
    return -(-heads // A_LOG_PAD) * A_LOG_PAD


def _entry(ours: str, shape: tuple[int, ...], config: K3Config) -> PlanEntry:
    name = released_name(ours, config)
    expert = _EXPERTS.search(name)
    if expert is None and name.endswith(".self_attn.A_log"):
        return PlanEntry(ours, shape, "a_log", (name,), ((_padded(shape[0]),),))
    if expert is None:
        return PlanEntry(ours, shape, "plain", (name,), (shape,))
    base, (num, rows, cols) = name[: expert.start()] + ".experts", shape
    if expert.group(1) == "gate_up_proj":  # [E, 2F, L] -> w1 (gate) [F, L] and w3 (up) [F, L]
        pairs = [(EXPERT_WEIGHTS[part], j) for part in ("gate", "up") for j in range(num)]
        names = [f"{base}.{j}.{w}.weight" for w, j in pairs]
        return PlanEntry(ours, shape, "gate_up", tuple(names), ((rows // 2, cols),) * (2 * num))
    names = [f"{base}.{j}.{EXPERT_WEIGHTS['down']}.weight" for j in range(num)]  # [E, L, F]
    return PlanEntry(ours, shape, "down", tuple(names), ((rows, cols),) * num)


def checkpoint_plan(config: K3Config) -> list[PlanEntry]:
    """Every tensor of our state dict (names and shapes from a meta-device model) with its
    released counterparts; a tied lm_head is left out (the release does not store it)."""
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return [_entry(name, tuple(t.shape), config) for name, t in state.items()]


# --- layouts ---------------------------------------------------------------------------------


def _split(entry: PlanEntry, tensor: Tensor) -> list[Tensor]:
    """Our tensor -> its released tensors (fresh storage: safetensors refuses shared views)."""
    if entry.kind == "plain":
        return [tensor]
    if entry.kind == "a_log":
        pad_P = tensor.new_zeros(entry.released_shapes[0])
        pad_P[: tensor.numel()] = tensor.reshape(-1)
        return [pad_P]
    if entry.kind == "gate_up":
        gate_EFL, up_EFL = tensor.chunk(2, dim=1)
        return [w.clone() for w in (*gate_EFL.unbind(0), *up_EFL.unbind(0))]
    return [w.clone() for w in tensor.unbind(0)]


def _join(entry: PlanEntry, tensors: list[Tensor]) -> Tensor:
    """Released tensors (shapes already checked) -> our tensor."""
    if entry.kind == "plain":
        return tensors[0]
    if entry.kind == "a_log":
        return tensors[0].reshape(-1)[: entry.shape[0]].clone()
    if entry.kind == "gate_up":
        num = len(tensors) // 2
        return torch.cat([torch.stack(tensors[:num]), torch.stack(tensors[num:])], dim=1)
    return torch.stack(tensors)


def _shape_problem(entry: PlanEntry, index: int, tensor: Tensor) -> str | None:
    """None if the released tensor has an accepted shape, else a description."""
    got, want = tuple(tensor.shape), entry.released_shapes[index]
    if entry.kind != "a_log":
        return None if got == want else f"{entry.released[index]}: {got}, expected {want}"
    heads = entry.shape[0]
    if got in ((heads,), (1, 1, heads, 1)):  # K3 modeling code / Kimi-Linear-48B layouts
        return None
    if len(got) == 1 and got[0] > heads:  # the release's zero-padded layout (any length)
        if bool((tensor[heads:] == 0).all()):
            return None
        return f"{entry.released[index]}: padding beyond the {heads} heads is not zero"
    return f"{entry.released[index]}: {got}, expected {want}, ({heads},) or (1, 1, {heads}, 1)"


# --- the two directions ----------------------------------------------------------------------


def _problems(title: str, items: Iterable[str]) -> str | None:
    items = list(items)
    if not items:
        return None
    more = f" (+{len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return f"{len(items)} {title}: {', '.join(items[:_SHOWN])}{more}"


def _raise_if(*problems: str | None) -> None:
    found = [p for p in problems if p]
    if found:
        raise ReleasedCheckpointError("; ".join(found))


def to_released(state_dict: Mapping[str, Tensor], config: K3Config) -> dict[str, Tensor]:
    """Our state dict -> tensors under the released names and layouts (strict both ways)."""
    plan = checkpoint_plan(config)
    expected = {e.ours for e in plan}
    extra = set(state_dict) - expected
    if config.tie_word_embeddings:
        extra.discard("lm_head.weight")
    wrong = [
        f"{e.ours}: {tuple(state_dict[e.ours].shape)}, expected {e.shape}"
        for e in plan
        if e.ours in state_dict and tuple(state_dict[e.ours].shape) != e.shape
    ]
    _raise_if(
        _problems("missing", sorted(expected - set(state_dict))),
        _problems("unexpected", sorted(extra)),
        _problems("misshapen", wrong),
    )
    out = {}
    for entry in plan:
        parts = _split(entry, state_dict[entry.ours].detach())
        out.update(zip(entry.released, parts, strict=True))
    return out


def _text_tensors(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Strip the vision-language release's `language_model.` prefix and drop its vision
    tensors; a text-only checkpoint passes unchanged."""
    if not any(name.startswith(VL_TEXT_PREFIX) for name in tensors):
        return dict(tensors)
    out, foreign = {}, []
    for name, tensor in tensors.items():
        if name.startswith(VL_TEXT_PREFIX):
            out[name[len(VL_TEXT_PREFIX) :]] = tensor
        elif not name.startswith(VL_SKIPPED_PREFIXES):
            foreign.append(name)
    _raise_if(_problems("unexpected (outside language_model.)", sorted(foreign)))
    return out


def _packed_experts(names: Iterable[str]) -> list[str]:
    return sorted(n for n in names if n.endswith((".weight_packed", ".weight_scale")))


def from_released(tensors: Mapping[str, Tensor], config: K3Config) -> dict[str, Tensor]:
    """Released tensors -> our state dict (names, layouts, shapes checked; nothing partial).

    A tied lm_head is filled from the embedding."""
    tensors = _text_tensors(tensors)
    packed = _packed_experts(tensors)
    if packed:
        raise ReleasedCheckpointError(
            f"{len(packed)} MXFP4-packed tensors (e.g. {packed[0]}): this loader reads "
            "unquantized `.weight` tensors only; dequantize the routed experts first"
        )
    plan = checkpoint_plan(config)
    wanted = [name for e in plan for name in e.released]
    missing = [name for name in wanted if name not in tensors]
    wrong = [
        problem
        for e in plan
        for i, name in enumerate(e.released)
        if name in tensors and (problem := _shape_problem(e, i, tensors[name]))
    ]
    _raise_if(
        _problems("missing", missing),
        _problems("unexpected", sorted(set(tensors) - set(wanted))),
        _problems("misshapen", wrong),
    )
    state = {e.ours: _join(e, [tensors[name] for name in e.released]) for e in plan}
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


# --- files -----------------------------------------------------------------------------------


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    """All tensors of a `.safetensors` file, or of every `*.safetensors` in a directory (a name
    in two files is an error)."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    tensors: dict[str, Tensor] = {}
    for file in files:
        part = load_file(str(file))
        twice = sorted(set(part) & set(tensors))
        _raise_if(_problems(f"tensors also in an earlier file than {file.name}", twice))
        tensors.update(part)
    return tensors


def _read_config(path: Path) -> K3Config:
    folder = path if path.is_dir() else path.parent
    config_file = folder / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"no config.json in {folder}; pass config= explicitly")
    return config_from_released(json.loads(config_file.read_text()))


def load_released(
    path: str | Path, config: K3Config | None = None, *, dtype: torch.dtype | None = None
) -> K3ForCausalLM:
    """A K3ForCausalLM (eval mode) from a released-format safetensors file or directory.

    config None: translated from the `config.json` next to the weights (config_from_released).
    dtype: cast the model before loading (router weight/bias and A_log, dt_bias stay as cast).
    """
    path = Path(path)
    config = _read_config(path) if config is None else config
    state = from_released(read_safetensors(path), config)
    model = K3ForCausalLM(config)
    if dtype is not None:
        model = model.to(dtype)
    model.load_state_dict(state, strict=True)
    return model.eval()


def save_released(
    state_dict: Mapping[str, Tensor],
    config: K3Config,
    folder: str | Path,
    *,
    adjust: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None,
) -> Path:
    """Write `model.safetensors` (released names) and `config.json` (released keys) into
    `folder`; `adjust` may rewrite the released tensors before saving (tests use it to write
    alternative layouts). Returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = to_released(state_dict, config)
    if adjust is not None:
        tensors = adjust(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config_to_released(config), indent=2))
    return folder
