"""Text in, text out: a checkpoint's tokenizer, incremental detokenisation and stop strings.

- `load_tokenizer(folder)`: the Hugging Face tokenizer a checkpoint folder carries (read by
  transformers' AutoTokenizer: its chat template too), or None where the folder has none.
- `Detokenizer`: a request's new tokens as text, a piece per token; a token that ends inside a
  character (byte-level BPE splits UTF-8) gives "" until the character is whole.
- `StopMatcher`: OpenAI's stop strings on that text: the text ends where the first stop begins (the
  stop is not part of it); text that may be the start of a stop is held back until it is known not to
  be; a stop counts only once the request has `min_tokens` tokens.
- `TextStream`: both for one request: per token, the text a client may be sent now and whether a
  stop string ended the request; the pieces of a stream join into the text a non-streamed answer has.
- `train_tiny_tokenizer(folder, vocab)`: the byte-level BPE (learnt from a fixed text) and chat
  template `python -m hisparse.make_tiny` writes beside a tiny checkpoint's weights.

Encoding and decoding go through the fast tokenizer's Rust core (`tokenizers.Tokenizer`), which never
changes state on a call, so the HTTP worker threads encode while the server thread decodes.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
CONTEXT_TOKENS = 4      # prompt tokens decoded before the first new one (SentencePiece's leading spaces need one)
MAX_STOPS = 16          # stop strings a request may carry (OpenAI takes 4; vLLM any number)
REPLACEMENT = "\ufffd"  # what decoding gives for bytes that do not yet make a whole character


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (the `tokenizers` ByteLevel's): the printable character each byte is
    written as in a byte-level BPE's vocabulary -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


BYTE_LEVEL = _byte_level_alphabet()

# ChatML (what Qwen's checkpoints use): every message between <|im_start|>role and <|im_end|>
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_EOS = "<|im_end|>"


class Tokenizer:
    """A checkpoint's tokenizer: `encode` (text -> ids, the tokenizer's special tokens added),
    `decode` (ids -> text, special tokens left out), `token_text` (one id as a log-probability lists
    it), `chat` (messages -> prompt ids through the chat template)."""

    def __init__(self, hf, folder: str):
        if not getattr(hf, "is_fast", False):
            raise ValueError(f"the tokenizer in {folder} has no fast (Rust) form: expected a tokenizer.json, or "
                             f"one transformers can convert")
        self.hf, self.folder = hf, folder
        self.core = hf.backend_tokenizer                 # tokenizers.Tokenizer: stateless encode and decode
        self.vocab_size = len(hf)                        # ids it can produce, added tokens included
        self.eos_token_ids = (hf.convert_tokens_to_ids(hf.eos_token),) if hf.eos_token else ()
        self.chat_template = hf.chat_template if isinstance(hf.chat_template, str) else None

    def encode(self, text: str, special: bool = True) -> list[int]:
        """ValueError where `text` is not Unicode a tokenizer can read (a lone surrogate, as JSON's
        unpaired \\ud800-\\udfff escapes and undecodable command-line bytes give)."""
        return self.core.encode(check_text(text), add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        return self.core.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """The text of one token as logprobs list it: special tokens by name, a piece of a character as U+FFFD."""
        return self.core.decode([token], skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token (OpenAI's logprobs `bytes`): its text's, or where that is a piece of a
        character (U+FFFD), the bytes its vocabulary entry stands for (byte-level BPE's alphabet,
        SentencePiece's <0xNN> byte fallback), so a client can join the pieces into the character."""
        text = self.token_text(token)
        piece = self.core.id_to_token(token) if REPLACEMENT in text else None
        if piece:
            fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)      # first: its characters are byte-level's too
            if fallback:
                return bytes([int(fallback.group(1), 16)])
            if all(c in BYTE_LEVEL for c in piece):
                return bytes(BYTE_LEVEL[c] for c in piece)
        return text.encode("utf-8")

    def chat(self, messages: list[dict]) -> tuple[str, list[int]]:
        """The prompt (text and ids) the chat template makes of `messages`, ending where the assistant's
        answer starts. ValueError if there is no template or it refuses the messages."""
        if self.chat_template is None:
            raise ValueError(f"the tokenizer in {self.folder} has no chat template")
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja2's errors, the template's raise_exception: the client's fault
            raise ValueError(f"the chat template refuses these messages: {exc}") from None
        return text, self.encode(text, special=False)    # the template writes the special tokens it wants


def check_text(text: str) -> str:
    """`text`, or ValueError where it holds a lone surrogate (not a character: no tokenizer reads it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text holds a lone surrogate ({text[exc.start]!r} at character {exc.start}), "
                         f"which is not a Unicode character: expected valid UTF-8 text") from None
    return text


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(folder: str | Path) -> Tokenizer | None:
    """The tokenizer of a checkpoint folder, None if it has none (no tokenizer.json, tokenizer_config.json
    or tokenizer.model). ValueError naming the folder if one is there and cannot be read."""
    if not has_tokenizer(folder):
        return None
    from transformers import AutoTokenizer      # seconds to import: only for checkpoints with a tokenizer
    from transformers.utils import logging
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()        # it reads config.json too, and warns of model types it does not know (nsa)
    try:
        hf = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises for a broken folder
        raise ValueError(f"the tokenizer in {folder} cannot be read: {exc}") from None
    finally:
        logging.set_verbosity(verbosity)
    return Tokenizer(hf, str(folder))


# -- one request's text ------------------------------------------------------------------------

class Detokenizer:
    """New tokens as text, a piece at a time. Each piece is the text a window of ids gains from its
    newest ones: the window starts at the previous piece's first id (before the first piece, a few
    prompt ids), so a tokenizer whose tokens' text depends on their neighbour (SentencePiece's leading
    space) decodes them as in the whole text; a window ending inside a character waits (U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt[-CONTEXT_TOKENS:])
        self.start = 0                   # the window's first id (ids before it are dropped)
        self.read = len(self.ids)        # ids before this one are in pieces handed out

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._piece(final=False)

    def flush(self) -> str:
        """What is left (a character cut short shows as U+FFFD), at the end of the request."""
        return self._piece(final=True)

    def _piece(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self.tokenizer.decode(self.ids[self.start:self.read])
        after = self.tokenizer.decode(self.ids[self.start:])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""                    # a special token (no text), or a character not yet whole
        del self.ids[:self.read]         # the next window starts at this piece's first id
        self.start, self.read = 0, len(self.ids)
        return after[len(before):]


class StopMatcher:
    """Stop strings on a request's text, fed a piece at a time (`add`): what may be sent now, and
    whether a stop ended it. A stop ends the text where it begins (the earliest among several). The
    longest tail of the text that is the start of a stop is held back; `flush` gives it at the end.
    Stops count once the request has min_tokens tokens (one ending in earlier text does not)."""

    def __init__(self, stops: tuple[str, ...] = (), min_tokens: int = 0):
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {stops!r}")
        self.stops, self.min_tokens = tuple(stops), min_tokens
        self.pending = ""                # text not sent yet: at most the start of a stop, plus the newest piece

    def add(self, text: str, tokens: int) -> tuple[str, bool]:
        """text: the piece of the request's `tokens`-th token."""
        old = len(self.pending)
        self.pending += text
        if self.stops and tokens >= self.min_tokens:
            found = [i for s in self.stops if (i := self.pending.find(s, max(0, old - len(s) + 1))) >= 0]
            if found:
                out, self.pending = self.pending[:min(found)], ""
                return out, True
        keep = self._start_of_a_stop()
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _start_of_a_stop(self) -> int:
        """Length of the longest tail of `pending` that a stop string begins with (shorter than the stop)."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest


class TextStream:
    """One request's output text: `add(token, tokens)` per token (its piece to send now, whether a stop
    string ended the request), `finish()` once at the end (the text held back till then)."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], stops: tuple[str, ...] = (), min_tokens: int = 0):
        self.detokenizer = Detokenizer(tokenizer, prompt)
        self.matcher = StopMatcher(stops, min_tokens)
        self.stopped = False

    def add(self, token: int, tokens: int) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        text, self.stopped = self.matcher.add(self.detokenizer.add(token), tokens)
        return text, self.stopped

    def finish(self, tokens: int) -> tuple[str, bool]:
        """The text left at the end (a stop may still complete in it: then cut there, and True)."""
        if self.stopped:
            return "", True
        text, self.stopped = self.matcher.add(self.detokenizer.flush(), tokens)
        return text + ("" if self.stopped else self.matcher.flush()), self.stopped


# -- the tiny checkpoints' tokenizer -----------------------------------------------------------

def training_text() -> list[str]:
    """The text the tiny tokenizer learns from: a fixed copy of DESIGN.md's first sections
    (`hisparse.models.tiny_corpus`), so it is the same tokenizer at every commit."""
    from hisparse.models.tiny_corpus import CORPUS
    return [CORPUS]


def train_tiny_tokenizer(folder: str | Path, vocab: int) -> int:
    """Write a byte-level BPE of `vocab` ids (256 bytes, the special tokens, merges learnt from
    `training_text`) with a ChatML chat template into `folder`, as Hugging Face lays a tokenizer out
    (tokenizer.json, tokenizer_config.json, special_tokens_map.json); its end-of-sequence id."""
    from tokenizers import Tokenizer as Core, decoders, models, pre_tokenizers, trainers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab={vocab}: a byte-level BPE needs at least {len(alphabet) + len(SPECIAL_TOKENS)} ids "
                         f"(256 bytes and {len(SPECIAL_TOKENS)} special tokens)")
    core = Core(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=alphabet,
                                  show_progress=False)
    core.train_from_iterator(training_text(), trainer)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    core.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20, "eos_token": TINY_EOS,
              "pad_token": SPECIAL_TOKENS[0], "bos_token": None, "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": TINY_EOS, "pad_token": SPECIAL_TOKENS[0]},
                                                            indent=2) + "\n")
    return core.token_to_id(TINY_EOS)
