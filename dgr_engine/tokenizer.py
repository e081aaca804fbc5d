"""Text in, text out: a GGUF's vocabulary through llama.cpp (the C ABI's vocab-only load), so
that dgr tokenizes, detokenizes and applies chat templates exactly as whole-model llama.cpp.

:class:`Tokenizer` loads no weights; for a split model open its first file. :class:`TextStream`
turns generated token ids into text as they come, holding back the bytes of a UTF-8 character
that a piece splits until the next piece completes it.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import attrs

from dgr_engine._binding import check_status, ffi, lib, status_name
from dgr_engine.errors import EngineClosed, UnsupportedFeature


@attrs.frozen
class VocabInfo:
    n_vocab: int
    bos: int | None
    eos: int | None
    eot: int | None
    add_bos: bool
    has_chat_template: bool
    has_tokenizer: bool
    """False: token ids only (a generated fixture's vocabulary type "none")."""


class Tokenizer:
    """A GGUF's vocabulary. Use ``with`` or :meth:`close`."""

    def __init__(self, model_path: str | os.PathLike[str]) -> None:
        self.model_path = Path(model_path)
        out = ffi.new("dgr_vocab **")
        check_status(lib.dgr_vocab_open(str(self.model_path).encode(), out))
        self._handle: Any = out[0]
        raw = ffi.new("dgr_vocab_info *")
        check_status(lib.dgr_vocab_get_info(self._handle, raw))

        def token(value: int) -> int | None:
            return None if value < 0 else int(value)

        self.info = VocabInfo(
            n_vocab=int(raw.n_vocab),
            bos=token(raw.bos),
            eos=token(raw.eos),
            eot=token(raw.eot),
            add_bos=bool(raw.add_bos),
            has_chat_template=bool(raw.has_chat_template),
            has_tokenizer=bool(raw.has_tokenizer),
        )
        self._eog: frozenset[int] | None = None

    def __enter__(self) -> Tokenizer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._handle is not None:
            lib.dgr_vocab_free(self._handle)
            self._handle = None

    def _live(self) -> Any:
        if self._handle is None:
            raise EngineClosed(f"tokenizer of {self.model_path.name} is closed")
        return self._handle

    def encode(
        self, text: str, *, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        """Token ids of ``text`` (with the BOS the model wants when ``add_special``)."""
        data = text.encode()
        count = ffi.new("int32_t *")
        capacity = len(data) + 8
        for _ in range(2):  # the second try has the exact size llama.cpp asked for
            tokens = ffi.new("int32_t[]", capacity)
            code = lib.dgr_vocab_tokenize(
                self._live(), data, len(data), add_special, parse_special, tokens, capacity, count
            )
            if code == 0:
                return [int(tokens[i]) for i in range(count[0])]
            if status_name(code) != "DGR_E_SHAPE":
                check_status(code)
            capacity = int(count[0])
        check_status(code)
        raise AssertionError("unreachable")

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of ``token``'s piece (possibly part of a UTF-8 character)."""
        size = ffi.new("int32_t *")
        buf = ffi.new("char[]", 64)
        code = lib.dgr_vocab_piece(self._live(), token, special, buf, 64, size)
        if code != 0 and status_name(code) == "DGR_E_SHAPE":
            buf = ffi.new("char[]", int(size[0]))
            code = lib.dgr_vocab_piece(self._live(), token, special, buf, int(size[0]), size)
        check_status(code)
        return bytes(ffi.buffer(buf, int(size[0])))

    def decode(self, tokens: Sequence[int], *, special: bool = False) -> str:
        """The text of ``tokens`` (invalid UTF-8 replaced)."""
        return b"".join(self.piece(t, special=special) for t in tokens).decode(errors="replace")

    def is_eog(self, token: int) -> bool:
        """``token`` ends a generation (EOS, EOT or another end-of-generation token)."""
        out = ffi.new("uint8_t *")
        check_status(lib.dgr_vocab_is_eog(self._live(), token, out))
        return bool(out[0])

    @property
    def eog_tokens(self) -> frozenset[int]:
        """Every end-of-generation token of the vocabulary."""
        if self._eog is None:
            self._eog = frozenset(t for t in range(self.info.n_vocab) if self.is_eog(t))
        return self._eog

    def chat(self, messages: Sequence[tuple[str, str]], *, add_assistant: bool = True) -> str:
        """The model's chat template applied to ``(role, content)`` messages;
        :class:`~dgr_engine.errors.UnsupportedFeature` when the GGUF has none."""
        if not self.info.has_chat_template:
            raise UnsupportedFeature(
                f"DGR_E_UNSUPPORTED: {self.model_path.name} has no chat template "
                "(tokenizer.chat_template)"
            )
        keep = [(r.encode(), c.encode()) for r, c in messages]
        cells = [ffi.new("char[]", b) for pair in keep for b in pair]
        array = ffi.new("dgr_chat_message[]", len(keep))
        for i in range(len(keep)):
            array[i].role, array[i].content = cells[2 * i], cells[2 * i + 1]
        size = ffi.new("int32_t *")
        capacity = 4 * sum(len(r) + len(c) + 16 for r, c in keep) + 256
        for _ in range(2):
            buf = ffi.new("char[]", capacity)
            code = lib.dgr_vocab_chat(
                self._live(), array, len(keep), add_assistant, buf, capacity, size
            )
            if code == 0:
                return bytes(ffi.buffer(buf, int(size[0]))).decode(errors="replace")
            if status_name(code) != "DGR_E_SHAPE":
                break
            capacity = int(size[0]) + 1
        check_status(code)
        raise AssertionError("unreachable")


class TextStream:
    """Generated tokens to text, incrementally: :meth:`push` returns the text that is complete
    so far (a UTF-8 character split across pieces waits for its last byte); :meth:`flush` what
    is left at the end."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return str(self._decoder.decode(self.tokenizer.piece(token)))

    def flush(self) -> str:
        return str(self._decoder.decode(b"", final=True))
