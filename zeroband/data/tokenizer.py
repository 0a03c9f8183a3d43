"""Byte-level BPE training and one tokenizer interface for the whole framework.

`TextTokenizer` wraps either a raw `tokenizers.Tokenizer` (our own `tokenizer.json`) or any local Hugging
Face tokenizer directory, so the loader, the trainer and the HF export never care which one it is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
# EOS spellings of common public tokenizers, tried when a bare tokenizer.json has no tokenizer_config.
_KNOWN_EOS = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
_MISSING_HINT = (
    "run `zeroband data` to build the demo tokenizer, or set data.tokenizer to a tokenizer directory"
)


def train_tokenizer(files: list[Path], vocab_size: int, out_dir: Path, text_field: str = "text") -> None:
    """Train a byte-level BPE on `files` (.jsonl/.json lines, .parquet or .txt) and save it to `out_dir`.

    One special token, `<|endoftext|>`, serves as EOS, BOS and padding: the packer only needs a separator.
    """
    tok = Tokenizer(models.BPE())
    # No prefix space: the packer concatenates documents, so a leading space would be a spurious token.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        # The full byte alphabet keeps every input encodable, whatever the training text lacked.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_iter_texts(files, text_field), trainer)
    save_hf_tokenizer(tok, Path(out_dir))


def _iter_texts(files: list[Path], text_field: str) -> Iterator[str]:
    for path in map(Path, files):
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer training file {str(path)!r} not found")
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            yield from (
                t for t in pq.read_table(path, columns=[text_field]).column(text_field).to_pylist() if t
            )
        elif path.suffix in (".jsonl", ".json"):
            with path.open(encoding="utf-8") as f:
                yield from (json.loads(line).get(text_field) or "" for line in f if line.strip())
        else:
            yield path.read_text(encoding="utf-8")


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path, eos_token: str = EOS_TOKEN) -> None:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json loadable by AutoTokenizer."""
    from transformers import PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    specials = {"bos_token": eos_token, "eos_token": eos_token, "pad_token": eos_token}
    PreTrainedTokenizerFast(tokenizer_object=tok, **specials).save_pretrained(str(out_dir))
    # transformers 5 writes class "TokenizersBackend", which 4.x cannot import; the generic name loads in both.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    # transformers 4.x reads special tokens from this file; 5.x ignores it.
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))


class TextTokenizer:
    """Encode/decode with either a `tokenizers.Tokenizer` or a Hugging Face tokenizer, same API."""

    def __init__(self, backend: Tokenizer | Any, eos_id: int) -> None:
        self._backend: Any = backend  # one of two APIs: self._raw says which
        self._raw = isinstance(backend, Tokenizer)
        self.eos_id = eos_id

    @classmethod
    def load(cls, path: str | Path) -> TextTokenizer:
        """Load a directory holding tokenizer.json, any local HF tokenizer directory, or a tokenizer.json file."""
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"tokenizer {str(p)!r} not found (data.tokenizer): {_MISSING_HINT}")
        if p.is_file():
            return cls._from_json(p)
        if (p / "tokenizer.json").is_file():
            tok = cls._from_json(p / "tokenizer.json")
            configured = _configured_eos(p)
            if configured is not None and tok._backend.token_to_id(configured) is not None:
                tok.eos_id = tok._backend.token_to_id(configured)
            return tok
        return cls._from_auto(p)

    @classmethod
    def _from_json(cls, file: Path) -> TextTokenizer:
        from zeroband.config import ConfigError

        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises a bare Exception: empty, binary, not a tokenizer
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"{file}: not a tokenizer.json ({'empty file' if file.stat().st_size == 0 else first}) "
                              f"(data.tokenizer). Fix: {_MISSING_HINT}") from None
        for name in _KNOWN_EOS:
            if (eos := tok.token_to_id(name)) is not None:
                return cls(tok, eos)
        raise ConfigError(f"{file}: no EOS token found (looked for {', '.join(_KNOWN_EOS)}) (data.tokenizer). "
                          f"Fix: {_MISSING_HINT}")

    @classmethod
    def _from_auto(cls, directory: Path) -> TextTokenizer:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as e:
            raise FileNotFoundError(f"{directory} is not a tokenizer directory ({e}): {_MISSING_HINT}") from e
        if tok.eos_token_id is None:
            from zeroband.config import ConfigError

            raise ConfigError(f"tokenizer {directory} defines no eos_token; the packer needs one (data.tokenizer)")
        return cls(tok, int(tok.eos_token_id))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without BOS/EOS (the packer adds EOS itself)."""
        if self._raw:
            return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]
        return self._backend(list(texts), add_special_tokens=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids))

    @property
    def vocab_size(self) -> int:
        """Number of ids the model must embed, special tokens included."""
        if self._raw:
            return self._backend.get_vocab_size(with_added_tokens=True)
        return len(self._backend)

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Write files that `transformers.AutoTokenizer.from_pretrained(out_dir)` loads (used by HF export)."""
        out = Path(out_dir)
        if self._raw:
            save_hf_tokenizer(self._backend, out, self._backend.id_to_token(self.eos_id))
        else:
            out.mkdir(parents=True, exist_ok=True)
            self._backend.save_pretrained(str(out))


def _configured_eos(directory: Path) -> str | None:
    """The eos_token named in tokenizer_config.json, if any (it may be a plain string or an AddedToken dict)."""
    cfg_path = directory / "tokenizer_config.json"
    if not cfg_path.is_file():
        return None
    eos = json.loads(cfg_path.read_text()).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos
