"""A corpus of hostile checkpoints, each with the one-line error mtpquant must give for it.

Built from a minimal valid two-shard checkpoint (a few KB). ``scripts/make_bad_checkpoints.py``
writes the corpus committed under ``tests/fixtures/bad/``; tests check every command against it.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.filesystem import atomic_write_json
from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.writer import PlannedTensor, write_safetensors
from mtpquant.families import resolve

__all__ = ["BAD_CASES", "make_bad_corpus", "make_minimal_checkpoint"]

SHARD_A = "model-00001-of-00002.safetensors"
SHARD_B = "model-00002-of-00002.safetensors"

MINIMAL_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "hidden_size": 16,
    "vocab_size": 32,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "mtp_num_hidden_layers": 1,
}


def _tensor(name: str, shape: tuple[int, ...], fill: int) -> PlannedTensor:
    n = 1
    for d in shape:
        n *= d
    return PlannedTensor(name, "BF16", shape, lambda: bytes([fill % 251, 0x3C]) * n)


def make_minimal_checkpoint(out: Path) -> Path:
    """A valid two-shard checkpoint: embeddings, a norm and the 15 MTP tensors (split over both shards)."""
    out.mkdir(parents=True, exist_ok=True)
    shapes = resolve(MINIMAL_CONFIG).expected_mtp_shapes()
    main = [_tensor("model.embed_tokens.weight", (32, 16), 1), _tensor("model.norm.weight", (16,), 2)]
    mtp = [_tensor(n, s, i) for i, (n, s) in enumerate(sorted(shapes.items()))]
    write_safetensors(out / SHARD_A, [*main, *mtp[:5]])
    write_safetensors(out / SHARD_B, mtp[5:])
    weight_map = {t.name: SHARD_A for t in [*main, *mtp[:5]]} | {t.name: SHARD_B for t in mtp[5:]}
    total = sum(t.nbytes for t in [*main, *mtp])
    atomic_write_json(out / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    atomic_write_json(out / "config.json", MINIMAL_CONFIG)
    return out


# ---- mutations --------------------------------------------------------------------------------
def _header(path: Path) -> tuple[int, dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _rewrite_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    _, header, data = _header(path)
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _edit_index(d: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    index = json.loads((d / INDEX_NAME).read_text())
    edit(index)
    (d / INDEX_NAME).write_text(json.dumps(index))


def _first_tensor(header: dict[str, Any]) -> str:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[0]


def _truncate(d: Path) -> None:
    p = d / SHARD_B
    p.write_bytes(p.read_bytes()[:-100])


def _header_too_long(d: Path) -> None:
    p = d / SHARD_A
    raw = p.read_bytes()
    p.write_bytes(struct.pack("<Q", len(raw) * 4) + raw[8:])


def _header_not_json(d: Path) -> None:
    p = d / SHARD_A
    n, _, data = _header(p)
    p.write_bytes(struct.pack("<Q", n) + b"{" * n + data)


def _header_not_object(d: Path) -> None:
    p = d / SHARD_A
    n, _, data = _header(p)
    body = b"[1, 2, 3]".ljust(n, b" ")
    p.write_bytes(struct.pack("<Q", n) + body + data)


def _overlap(d: Path) -> None:
    def edit(h: dict[str, Any]) -> None:
        names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
        a, b = h[names[0]], h[names[1]]
        size = b["data_offsets"][1] - b["data_offsets"][0]
        b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + size]

    _rewrite_header(d / SHARD_A, edit)


def _out_of_bounds(d: Path) -> None:
    def edit(h: dict[str, Any]) -> None:
        h[_first_tensor(h)]["data_offsets"] = [0, 10**9]

    _rewrite_header(d / SHARD_A, edit)


def _dtype_shape_mismatch(d: Path) -> None:
    def edit(h: dict[str, Any]) -> None:
        h["model.norm.weight"]["shape"] = [17]

    _rewrite_header(d / SHARD_A, edit)


def _unknown_dtype(d: Path) -> None:
    def edit(h: dict[str, Any]) -> None:
        h["model.norm.weight"]["dtype"] = "Q4_K"

    _rewrite_header(d / SHARD_A, edit)


def _index_missing_shard(d: Path) -> None:
    (d / SHARD_B).unlink()


def _index_tensor_absent(d: Path) -> None:
    _edit_index(d, lambda i: i["weight_map"].__setitem__("mtp.ghost.weight", SHARD_B))


def _shard_dotdot(d: Path) -> None:
    _edit_index(d, lambda i: i["weight_map"].__setitem__("mtp.fc.weight", "../" + SHARD_B))


def _shard_absolute(d: Path) -> None:
    _edit_index(d, lambda i: i["weight_map"].__setitem__("mtp.fc.weight", "/tmp/" + SHARD_B))


def _shard_suffix(d: Path) -> None:
    _edit_index(d, lambda i: i["weight_map"].__setitem__("mtp.fc.weight", "model-00002-of-00002.bin"))


def _duplicate_across_shards(d: Path) -> None:
    write_safetensors(
        d / "extra.safetensors", [_tensor("model.norm.weight", (16,), 7), _tensor("model.extra", (16,), 8)]
    )
    _edit_index(d, lambda i: i["weight_map"].__setitem__("model.extra", "extra.safetensors"))


def _config_missing(d: Path) -> None:
    (d / "config.json").unlink()


def _config_contradicts(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    config["hidden_size"] = 32
    (d / "config.json").write_text(json.dumps(config))


def _pickle(d: Path) -> None:
    for p in d.glob("*.safetensors"):
        p.unlink()
    (d / INDEX_NAME).unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04\x95 not loaded, ever")


_DEEP = 100_000  # levels of nesting: far past what Python's JSON parser recurses into


def _config_deep(d: Path) -> None:
    (d / "config.json").write_text("[" * _DEEP + "]" * _DEEP)


def _index_deep(d: Path) -> None:
    (d / INDEX_NAME).write_text('{"weight_map": ' + "[" * _DEEP + "]" * _DEEP + "}")


def _header_deep(d: Path) -> None:
    p = d / SHARD_A
    _, _, data = _header(p)
    body = ('{"x": ' + "[" * _DEEP + "]" * _DEEP + "}").encode()
    body += b" " * (-len(body) % 8)
    p.write_bytes(struct.pack("<Q", len(body)) + body + data)


def _config_mtp_layers_huge(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 10**9
    (d / "config.json").write_text(json.dumps(config))


def _config_experts_huge(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    config["num_experts"] = 10**9
    (d / "config.json").write_text(json.dumps(config))


def _config_layer_types(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    config["layer_types"] = ["linear_attention", "full_attention"]  # two kinds for its one layer
    (d / "config.json").write_text(json.dumps(config))


def _symlink_out(d: Path) -> None:
    # a link out of the checkpoint (a git clone or an archive can carry one): here to the corpus' expected.json
    (d / "notes.txt").symlink_to(Path("..") / "expected.json")


def _unsupported(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    config["architectures"], config["model_type"] = ["LlamaForCausalLM"], "llama"
    # declaring no MTP: an unknown architecture that declares one gets inspect's generic checks (families.generic)
    config.pop("mtp_num_hidden_layers", None)
    (d / "config.json").write_text(json.dumps(config))


# name -> (mutation, exact one-line message)
BAD_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated-shard": (
        _truncate,
        f"{SHARD_B}: tensor 'mtp.layers.0.self_attn.v_proj.weight': data_offsets [2144, 2656] run past the end of "
        "the data (2652 bytes): truncated file?",
    ),
    "header-longer-than-file": (
        _header_too_long,
        f"{SHARD_A}: header length 23264 is larger than the file (5816 bytes)",
    ),
    "header-not-json": (_header_not_json, f"{SHARD_A}: header is not valid JSON (JSONDecodeError)"),
    "header-not-object": (_header_not_object, f"{SHARD_A}: header is not a JSON object"),
    "overlapping-tensors": (
        _overlap,
        f"{SHARD_A}: tensors 'model.norm.weight' and 'model.embed_tokens.weight' overlap",
    ),
    "out-of-bounds": (
        _out_of_bounds,
        f"{SHARD_A}: tensor 'model.embed_tokens.weight': data_offsets [0, 1000000000] run past the end of the data "
        "(5184 bytes): truncated file?",
    ),
    "dtype-shape-mismatch": (
        _dtype_shape_mismatch,
        f"{SHARD_A}: tensor 'model.norm.weight': holds 32 bytes but BF16 x [17] needs 34 bytes",
    ),
    "unknown-dtype": (_unknown_dtype, f"{SHARD_A}: tensor 'model.norm.weight': unknown dtype 'Q4_K'"),
    "index-missing-shard": (_index_missing_shard, f"{INDEX_NAME}: shard '{SHARD_B}' does not exist"),
    "index-tensor-absent": (
        _index_tensor_absent,
        f"{INDEX_NAME}: tensor 'mtp.ghost.weight' is mapped to {SHARD_B} but {SHARD_B} does not contain it",
    ),
    "shard-name-dotdot": (
        _shard_dotdot,
        f"{INDEX_NAME}: shard name '../{SHARD_B}' is not a relative .safetensors file name",
    ),
    "shard-name-absolute": (
        _shard_absolute,
        f"{INDEX_NAME}: shard name '/tmp/{SHARD_B}' is not a relative .safetensors file name",
    ),
    "shard-name-suffix": (
        _shard_suffix,
        f"{INDEX_NAME}: shard name 'model-00002-of-00002.bin' is not a relative .safetensors file name",
    ),
    "duplicate-across-shards": (
        _duplicate_across_shards,
        "extra.safetensors: tensor 'model.norm.weight' also appears in model-00001-of-00002.safetensors, where the "
        "index maps it",
    ),
    "config-missing": (_config_missing, "{label}: config.json is missing"),
    "config-contradicts-tensors": (
        _config_contradicts,
        f"config.json implies mtp.fc.weight of shape [32, 64], but {SHARD_A} holds [16, 32]",
    ),
    "pickle-checkpoint": (
        _pickle,
        "{label}: pytorch_model.bin is a pickle checkpoint; mtpquant never loads pickles (convert it to safetensors)",
    ),
    "config-deep-json": (
        _config_deep,
        "config.json: not readable JSON (nested deeper than the JSON parser allows)",
    ),
    "index-deep-json": (
        _index_deep,
        f"{INDEX_NAME}: not readable JSON (nested deeper than the JSON parser allows)",
    ),
    "header-deep-json": (_header_deep, f"{SHARD_A}: header is nested deeper than the JSON parser allows"),
    "config-mtp-layers-huge": (
        _config_mtp_layers_huge,
        "config.json: mtp_num_hidden_layers = 1000000000 declares more MTP layers than any model has (at most 16)",
    ),
    "config-experts-huge": (
        _config_experts_huge,
        "config.json: num_experts = 1000000000 is outside what any model has (0 to 4096)",
    ),
    "config-layer-types": (
        _config_layer_types,
        "config.json: layer_types lists 2 layers but num_hidden_layers is 1",
    ),
    "symlink-out": (
        _symlink_out,
        "{label}: notes.txt is a symbolic link that leads outside the checkpoint; mtpquant never follows a link out "
        "of a checkpoint (copy the file into it)",
    ),
    "unsupported-architecture": (
        _unsupported,
        "config.json: unsupported architecture LlamaForCausalLM; supported: BailingMoeV2_5ForCausalLM, "
        "BailingMoeV3ForCausalLM, BailingMoeV3VLForConditionalGeneration, DeepseekV32ForCausalLM, "
        "DeepseekV3ForCausalLM, DeepseekV41ForCausalLM, DeepseekV4ForCausalLM, "
        "DeepseekV4ForConditionalGeneration, Dots3NoteForCausalLM, Ernie4_5_MoeForCausalLM, "
        "Exaone4_5_ForConditionalGeneration, ExaoneMoEForCausalLM, ExaoneMoeForCausalLM, Gemma4ForCausalLM, "
        "Gemma4ForConditionalGeneration, Gemma4UnifiedForConditionalGeneration, Glm4MoeForCausalLM, "
        "Glm4MoeLiteForCausalLM, Glm5NextForCausalLM, Glm5NextForConditionalGeneration, GlmMoeDsaForCausalLM,"
        " GlmOcrForConditionalGeneration, HYV3ForCausalLM, HYV4ForCausalLM, InklingForCausalLM, "
        "InklingForConditionalGeneration, InternS2MobiusForConditionalGeneration, "
        "InternS2PreviewForConditionalGeneration, KimiK3ForCausalLM, KimiK3ForConditionalGeneration, "
        "LongcatFlashForCausalLM, LongcatFlashNgramForCausalLM, MiMoForCausalLM, MiMoV2FlashForCausalLM, "
        "MiMoV2ForCausalLM, MiMoV2OmniForCausalLM, MiniMaxM2ForCausalLM, MiniMaxM3SparseForCausalLM, "
        "MiniMaxM3SparseForConditionalGeneration, NemotronHForCausalLM, NemotronHPuzzleForCausalLM, "
        "PanguUltraMoEForCausalLM, Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,"
        " Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration, Qwen4ExpForCausalLM, "
        "Qwen4ExpForConditionalGeneration, Step3p5ForCausalLM, Step3p7ForConditionalGeneration",
    ),
}


def make_bad_corpus(out: Path) -> dict[str, str]:
    """Write every case under ``out/<case>/`` and ``out/expected.json``; returns case -> message."""
    out.mkdir(parents=True, exist_ok=True)
    expected = {}
    for name, (mutate, message) in BAD_CASES.items():
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        make_minimal_checkpoint(d)
        mutate(d)
        expected[name] = message
    atomic_write_json(out / "expected.json", expected)
    return expected
