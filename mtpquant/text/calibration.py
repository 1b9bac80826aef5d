"""Calibration data: real text, tokenised with the model's own tokenizer (and chat template).

The offline default is text every CPython ships (``mtpquant.text.corpus``: the language reference's
pydoc topics and standard-library source), so calibration needs no download and gives the same
samples on every machine. Each document becomes a conversation (a short user request, the document
as the assistant's answer) when the tokenizer has a chat template, because that is the position
where a served model generates and its MTP drafts. Samples are cut from the concatenated token
stream into fixed-length rows, so no padding or attention mask is ever needed.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpquant.errors import CalibrationDataError
from mtpquant.hfconfig import refusal
from mtpquant.net import safejson

if TYPE_CHECKING:
    import torch

__all__ = ["CalibrationData", "build_calibration_data", "describe_source", "load_tokenizer"]

log = logging.getLogger(__name__)

OFFLINE = "offline"


@dataclass(frozen=True)
class CalibrationData:
    """Token rows ``[samples, seq_len]`` and where they came from."""

    input_ids: torch.Tensor
    source: str
    documents: int
    chat_template: bool

    @property
    def samples(self) -> int:
        """Number of rows."""
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        """Tokens per row."""
        return int(self.input_ids.shape[1])

    def batches(self, batch_size: int) -> Iterator[torch.Tensor]:
        """Rows in batches of ``batch_size``."""
        for start in range(0, self.samples, batch_size):
            yield self.input_ids[start : start + batch_size]


def describe_source(data: str) -> str:
    """Human description of a calibration data setting."""
    if data == OFFLINE:
        return "offline text shipped with CPython (pydoc topics + standard-library source)"
    if Path(data).is_file():
        return f"file {data}"
    return f"datasets:{data}"


def load_tokenizer(path: str | Path) -> Any:
    """The model's own tokenizer, or a one-line error (a config.json transformers refuses while loading it is a config
    error, exit 3, not a tokenizer failure).

    With a ``tokenizer.json`` it is that file exactly as written (transformers' ``TokenizersBackend``, the class
    ``AutoTokenizer`` chose for these checkpoints before 5.16), so calibration tokenises as validate does
    (``validate.prompts.tokenize_prompts`` reads the same file with ``tokenizers``). Since 5.16 ``AutoTokenizer``
    maps ``qwen3_5`` / ``qwen4_exp`` to ``Qwen3_5Tokenizer``, which replaces the file's pre-tokenizer with Qwen's
    regex: the same tokens for a real Qwen ``tokenizer.json`` (it carries that regex), different ones for a
    tokenizer trained with another pre-tokenizer, such as the tiny models'. Without ``tokenizer.json``:
    ``AutoTokenizer``.
    """
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoTokenizer, TokenizersBackend

    loader: Any = TokenizersBackend if (Path(path) / "tokenizer.json").is_file() else AutoTokenizer
    try:
        return loader.from_pretrained(str(path), trust_remote_code=False)
    except StrictDataclassError as exc:  # transformers read config.json (for the tokenizer class) and refused it
        raise refusal(exc, f"{path}/config.json") from None
    except Exception as exc:  # transformers raises many types here; all mean "no usable tokenizer"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise CalibrationDataError(
            f"{path}: cannot load the model's tokenizer ({first}); calibration needs it"
        ) from None


def _offline_documents(exclude: Collection[str] = ()) -> list[tuple[str, str]]:
    """(user request, text) pairs from the offline corpus, without the documents named in ``exclude``."""
    from mtpquant.text.corpus import offline_documents

    out = []
    for name, text in offline_documents("mixed"):
        if name in exclude:
            continue
        kind, _, topic = name.partition(":")
        if kind == "stdlib":
            prompt = f"Show me the source code of the Python standard-library module `{topic}`."
        else:
            prompt = f"Explain the Python language topic '{topic}'."
        out.append((prompt, text))
    return out


def _file_documents(path: Path) -> list[tuple[str | None, Any]]:
    """Documents from a .jsonl (``text`` or ``messages`` per line) or a plain text file."""
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationDataError(f"{path}: cannot read calibration data ({exc.__class__.__name__})") from None
    if path.suffix.lower() in {".jsonl", ".json"}:
        docs: list[tuple[str | None, Any]] = []
        for lineno, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = safejson.loads(line)
            except ValueError:
                raise CalibrationDataError(f"{path}:{lineno}: not a JSON object") from None
            if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
                docs.append((None, obj["messages"]))
            elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
                docs.append((None, obj["text"]))
            else:
                raise CalibrationDataError(f"{path}:{lineno}: expected an object with 'text' or 'messages'")
        return docs
    # Plain text: paragraphs separated by blank lines are documents.
    return [(None, p) for p in raw.split("\n\n") if p.strip()]


def _dataset_documents(name: str, limit: int) -> list[tuple[str | None, Any]]:
    try:
        import datasets
    except ImportError:
        raise CalibrationDataError(
            f"calibration data {name!r} is not a file, and loading it as a dataset needs the `datasets` "
            "package (pip install datasets), which is not installed"
        ) from None
    dataset_name, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(dataset_name, config or None, split="train", streaming=True)
    except Exception as exc:  # the datasets library raises many types for a bad name
        raise CalibrationDataError(f"cannot load dataset {name!r} ({exc.__class__.__name__}: {exc})") from None
    docs: list[tuple[str | None, Any]] = []
    for row in ds:
        if isinstance(row.get("messages"), list):
            docs.append((None, row["messages"]))
        elif isinstance(row.get("text"), str):
            docs.append((None, row["text"]))
        else:
            raise CalibrationDataError(f"dataset {name!r}: rows need a 'text' or 'messages' column")
        if len(docs) >= limit:
            break
    return docs


def _render(tokenizer: Any, prompt: str | None, doc: Any, chat: bool) -> list[int]:
    """Token ids of one document, through the chat template when there is one."""
    if chat:
        messages = (
            doc
            if isinstance(doc, list)
            else [{"role": "user", "content": prompt or "Continue."}, {"role": "assistant", "content": doc}]
        )
        try:
            ids = tokenizer.apply_chat_template(messages, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        except Exception as exc:  # a template may reject a conversation shape; fall back to plain text
            log.debug("chat template failed (%s); using plain text", exc)
    if isinstance(doc, list):
        doc = "\n\n".join(str(m.get("content", "")) for m in doc if isinstance(m, dict))
    return [int(i) for i in tokenizer(str(doc), add_special_tokens=False)["input_ids"]]


def build_calibration_data(
    tokenizer: Any,
    data: str,
    samples: int,
    seq_len: int,
    *,
    chat_template: bool = True,
    bar: Any = None,
    exclude: Collection[str] = (),
) -> CalibrationData:
    """``samples`` rows of ``seq_len`` tokens from ``data`` (offline | file | datasets name); ``bar``: a progress
    bar (tqdm) counting the tokens; ``exclude`` names offline-corpus documents to leave out (heal keeps validate's
    held-out prompts out of its training data)."""
    import torch

    chat = bool(chat_template and getattr(tokenizer, "chat_template", None))
    docs: list[tuple[str | None, Any]]
    if data == OFFLINE:
        docs = list(_offline_documents(exclude))
    elif Path(data).is_file():
        docs = _file_documents(Path(data))
    elif Path(data).suffix.lower() in {".txt", ".jsonl", ".json"} or ("/" in data and Path(data).parent.exists()):
        raise CalibrationDataError(f"{data}: calibration data file does not exist")
    else:
        docs = _dataset_documents(data, limit=max(64, samples * 4))
    need = samples * seq_len
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    used = 0
    for prompt, doc in docs:
        ids = _render(tokenizer, prompt, doc, chat)
        if not ids:
            continue
        before = len(stream)
        stream.extend(ids)
        if eos is not None and not chat:
            stream.append(int(eos))
        used += 1
        if bar is not None:
            bar.update(min(len(stream), need) - min(before, need))
        if len(stream) >= need:
            break
    if len(stream) < seq_len:
        raise CalibrationDataError(
            f"{describe_source(data)}: only {len(stream)} tokens, fewer than one row of {seq_len}"
        )
    rows = min(samples, len(stream) // seq_len)
    if rows < samples:
        log.warning("calibration data has %d tokens: %d rows of %d instead of %d", len(stream), rows, seq_len, samples)
    rows_t = torch.tensor(stream[: rows * seq_len], dtype=torch.long).view(rows, seq_len)
    log.info(
        "calibration: %d x %d tokens from %s (%d documents%s)",
        rows,
        seq_len,
        describe_source(data),
        used,
        ", chat template" if chat else "",
    )
    return CalibrationData(rows_t, describe_source(data), used, chat)


def check_calibration_source(data: str) -> None:
    """Refuse early a calibration file that does not exist or a dataset name without `datasets`."""
    import importlib.util

    if data == "offline" or Path(data).is_file():
        return
    if Path(data).suffix.lower() in {".txt", ".jsonl", ".json"} or data.startswith((".", "/", "~")):
        raise CalibrationDataError(f"{data}: calibration data file does not exist")
    if importlib.util.find_spec("datasets") is None:
        raise CalibrationDataError(
            f"calibration data {data!r} is not a file, and loading it as a dataset needs the `datasets` package "
            "(pip install datasets), which is not installed"
        )
