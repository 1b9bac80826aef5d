"""The header table's classes, computed once and shared: ``families.group_by_class`` against the classifier name by
name, a repair's view of a checkpoint (``Checkpoint.amended``) against the same table worked out from scratch, and
the exclusion matcher's wildcard-free patterns against ``fnmatch`` pattern by pattern."""

from __future__ import annotations

import fnmatch
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpquant.checkpoint.header import TensorEntry
from mtpquant.checkpoint.precision import linear_precisions
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.engine.loading import FusedShardsError, expand_modelopt_patterns, modelopt_excluded
from mtpquant.families import APPENDED, NAMESPACE, SUBSPACE, MtpNames, group_by_class, tensor_classifier

pytestmark = pytest.mark.dev

LAYOUTS = Path(__file__).resolve().parent / "fixtures" / "real-layouts"

# one MTP name test per storage class: Qwen's mtp.*, MiMo-V2's model.mtp.*, DeepSeek-V3's appended layers from 4 on
NAME_TESTS = (
    MtpNames(NAMESPACE, ("mtp.layers.",), 0, 1, "mtp."),
    MtpNames(SUBSPACE, ("model.mtp.layers.",), 0, 1, "model.mtp."),
    MtpNames(APPENDED, ("model.layers.",), 4, 1),
)
# fragments that straddle every prefix the classes test (mtp. / model.mtp. / model.visual. / lm_head. / the main
# prefix / its embed_tokens.), so that names share and differ in exactly the characters that decide
_PIECES = ("model.", "mtp.", "mtp", "layers.", "3.", "4.", "12.", "visual.", "embed_tokens.", "embed_tokens",
           "lm_head.", "lm_head", "language_model.", "mlp.", "weight", "x", ".")


def _by_name(names: list[str], main_prefix: str, has_vision: bool, test: MtpNames) -> dict[str, dict[str, int]]:
    """The oracle: every name through the classifier, one at a time."""
    classify = tensor_classifier(main_prefix, has_vision, test)
    groups: dict[str, dict[str, int]] = defaultdict(dict)
    for i, name in enumerate(names):
        groups[classify(name)][name] = i
    return dict(groups)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=6).map("".join), max_size=40, unique=True),
    st.sampled_from(("model.", "model.language_model.", "")),
    st.booleans(),
    st.sampled_from(NAME_TESTS),
)
def test_group_by_class_equals_the_classifier_name_by_name(
    names: list[str], main_prefix: str, has_vision: bool, test: MtpNames
) -> None:
    table = {n: i for i, n in enumerate(names)}
    got = group_by_class(table, main_prefix, has_vision, test)
    want = _by_name(names, main_prefix, has_vision, test)
    assert got == want
    assert [list(g) for g in got.values()] == [list(g) for g in want.values()]  # each group in the table's order


def _skeleton(tmp_path: Path, quant: bool) -> Checkpoint:
    from tests.support.skeleton import find_layout, make_skeleton

    layout = find_layout("Qwen3.5-0.8B-Base", LAYOUTS)
    return Checkpoint.open(make_skeleton(layout, tmp_path / ("q" if quant else "src"), quant=quant).path, strict=False)


def _assert_as_if_opened(view: Checkpoint) -> None:
    """Everything a view derives from its base equals the same table worked out from scratch."""
    tensors = view.tensors
    classify = tensor_classifier(view.main_prefix or view.spec.main_prefix, view.spec.family.has_vision,
                                 view.spec.mtp_names)
    oracle: dict[str, list[TensorEntry]] = defaultdict(list)
    for name in sorted(tensors):
        oracle[classify(name)].append(tensors[name])
    assert view.by_class() == dict(oracle)
    assert list(view.by_class()) == list(oracle)
    assert view.linear_precisions() == linear_precisions(tensors)
    assert list(view.linear_precisions()) == list(linear_precisions(tensors))
    assert view.total_bytes == sum(e.nbytes for e in tensors.values())
    mtp = sorted(n for n in tensors if view.spec.mtp_names.is_mtp(n))
    assert [e.name for e in view.mtp_tensors()] == mtp
    assert view.mtp_only == (bool(tensors) and len(mtp) == len(tensors))


def test_a_view_with_an_mtp_put_in_is_the_table_worked_out_afresh(tmp_path: Path) -> None:
    quant, src = _skeleton(tmp_path, quant=True), _skeleton(tmp_path, quant=False)
    assert not quant.mtp_tensors() and src.mtp_tensors()
    mtp = {e.name: e for e in src.mtp_tensors()}
    view = quant.amended(quant.config, quant.hf_quant_config, mtp)
    assert list(view.tensors) == [*quant.tensors, *mtp]
    _assert_as_if_opened(view)
    assert view.classes().groups["main"] is quant.classes().groups["main"]  # shared, not recomputed
    again = view.amended({**view.config, "x": 1}, None)  # new metadata only: the very same classes
    assert again.classes() is view.classes()
    _assert_as_if_opened(again)
    assert quant.total_bytes == sum(e.nbytes for e in quant.tensors.values())  # the base is untouched


def test_a_view_that_replaces_an_mtp_drops_the_old_one(tmp_path: Path) -> None:
    src = _skeleton(tmp_path, quant=False)
    present = src.mtp_tensors()
    half = {e.name: e for e in present[: len(present) // 2]}
    view = src.amended(src.config, src.hf_quant_config, half)
    assert set(view.tensors) == {n for n in src.tensors if not src.is_mtp(n)} | set(half)
    _assert_as_if_opened(view)
    none = src.amended(src.config, src.hf_quant_config, {})
    assert not none.mtp_tensors() and "mtp" not in none.by_class()
    _assert_as_if_opened(none)


_PATTERN_PIECES = ("model.", "layers.", "0", "1", ".", "mlp.", "gate", "*", "?", "[01]", "mtp", "fc", "experts",
                   "q_proj", "k_proj", "qkv_proj")
_PACKED = {"qkv_proj": ("q_proj", "k_proj")}


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from(_PATTERN_PIECES), min_size=1, max_size=5).map("".join), min_size=1, max_size=6),
    st.lists(st.sampled_from([p for p in _PATTERN_PIECES if p not in "*?[01]"]), min_size=1, max_size=6).map("".join),
    st.booleans(),
)
def test_modelopt_exclusion_equals_vllms_tests_pattern_by_pattern(
    patterns: list[str], prefix: str, listed: bool
) -> None:
    """vLLM's ``is_layer_excluded``: a packed module whose shards are all listed is excluded (some but not all: an
    error); otherwise some expanded pattern is the name, is in it, or matches it by ``fnmatch``, whether or not the
    pattern has a wildcard (``listed``: the module's own name is one of them)."""
    patterns = [*patterns, prefix] if listed else patterns
    expanded = expand_modelopt_patterns(patterns)
    base, _, last = prefix.rpartition(".")
    hits = [f"{base}.{s}" in expanded for s in _PACKED.get(last, ())]
    if any(hits) and not all(hits):
        with pytest.raises(FusedShardsError):
            modelopt_excluded(prefix, patterns, _PACKED)
        return
    want = (bool(hits) and all(hits)) or any(
        p == prefix or p in prefix or fnmatch.fnmatchcase(prefix, p) for p in expanded
    )
    assert modelopt_excluded(prefix, patterns, _PACKED) == want
