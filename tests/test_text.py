"""hisparse.text: the tiny checkpoints' tokenizer and chat template, incremental detokenisation (its
pieces join into the whole decode, a character split across tokens waits until whole) and stop
strings (OpenAI's trim, split across tokens, held back while they may start, min_tokens)."""
import random
from pathlib import Path

import pytest

from hisparse.models.tiny import TOKENIZER_VOCAB, write_tiny_checkpoint
from hisparse.text import (
    Detokenizer,
    StopMatcher,
    TextStream,
    Tokenizer,
    load_tokenizer,
    train_tiny_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    train_tiny_tokenizer(folder, TOKENIZER_VOCAB)
    return load_tokenizer(folder)


def test_the_tiny_tokenizer_round_trips_text_and_is_the_same_every_time(tokenizer, tmp_path):
    text = "Hello wörld ☃: the hot cache holds 4096 slots.\n"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text and max(ids) < TOKENIZER_VOCAB and len(ids) < len(text.encode())
    assert tokenizer.vocab_size == TOKENIZER_VOCAB and tokenizer.eos_token_ids == (2,)
    assert train_tiny_tokenizer(tmp_path, TOKENIZER_VOCAB) == 2
    assert (tmp_path / "tokenizer.json").read_bytes() == (Path(tokenizer.folder) / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="at least 259"):
        train_tiny_tokenizer(tmp_path / "small", 97)


def test_the_chat_template_ends_where_the_answer_starts(tokenizer):
    text, ids = tokenizer.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tokenizer.encode(text, special=False) and ids.count(1) == 3     # <|im_start|> is one token


def test_a_checkpoint_folder_with_and_without_a_tokenizer(tmp_path):
    bare = write_tiny_checkpoint("llama", tmp_path / "bare")
    assert load_tokenizer(bare) is None
    full = write_tiny_checkpoint("llama", tmp_path / "full", tokenizer=True)
    tokenizer = load_tokenizer(full)
    assert tokenizer.vocab_size == TOKENIZER_VOCAB and tokenizer.chat_template is not None
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken"):
        load_tokenizer(tmp_path / "broken")


def test_detokenized_pieces_join_into_the_whole_decode(tokenizer):
    """Random ids (bytes that make no character included) after prompts of a few words: the pieces
    plus the flush are tokenizer.decode of the new ids."""
    rng = random.Random(3)
    words = ["cache", " slot", "é", " ☃", "\n", " the"]
    for _ in range(200):
        prompt = tokenizer.encode("".join(rng.choices(words, k=rng.randrange(0, 6))))
        new = [rng.randrange(TOKENIZER_VOCAB) for _ in range(rng.randrange(1, 40))]
        detokenizer = Detokenizer(tokenizer, prompt)
        assert "".join(detokenizer.add(t) for t in new) + detokenizer.flush() == tokenizer.decode(new), new


def test_a_character_split_across_tokens_waits_until_whole(tokenizer):
    snowman = tokenizer.encode("☃")                 # three bytes, one token each here
    assert len(snowman) == 3
    detokenizer = Detokenizer(tokenizer, tokenizer.encode("x"))
    assert [detokenizer.add(t) for t in snowman] == ["", "", "☃"]
    cut = Detokenizer(tokenizer, [])
    assert cut.add(snowman[0]) == "" and cut.flush() == "\ufffd"      # cut short at the end: shown as U+FFFD
    eos = Detokenizer(tokenizer, [])
    word = tokenizer.encode(" the")
    assert len(word) == 1 and eos.add(2) == "" and eos.add(word[0]) == " the"    # a special token has no text


def test_a_tokens_bytes_are_its_own_where_its_text_is_a_piece_of_a_character(tokenizer):
    """OpenAI's logprobs `bytes` let a client join tokens that split a character: each token's own
    bytes, not U+FFFD's (what its text alone decodes to)."""
    ids = tokenizer.encode("☃é x")
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == "☃é x".encode()
    assert tokenizer.token_text(ids[0]) == "\ufffd" and tokenizer.token_bytes(ids[0]) == "☃".encode()[:1]
    assert tokenizer.token_bytes(2) == b"<|im_end|>"                   # a special token: its name, as its text


def test_a_byte_fallback_tokens_bytes_are_the_byte_it_names():
    """SentencePiece-style vocabularies (Llama, Mistral, Gemma) spell a byte as <0xNN>; its characters
    are printable ASCII, so the byte-level alphabet would read them as six bytes: the fallback is read
    first."""
    from tokenizers import Tokenizer as Core
    from tokenizers import decoders, models
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<0xE2>": 1, "<0x98>": 2, "<0x83>": 3, "a": 4}
    core = Core(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    core.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=core), "byte-fallback")
    ids = tokenizer.encode("☃a", special=False)
    assert ids == [1, 2, 3, 4] and tokenizer.token_text(1) == "\ufffd"
    assert [tokenizer.token_bytes(t) for t in ids] == [b"\xe2", b"\x98", b"\x83", b"a"]


def feed(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    out, stopped = [], False
    for n, piece in enumerate(pieces, 1):
        text, stopped = matcher.add(piece, n)
        out.append(text)
        if stopped:
            break
    return out, stopped


@pytest.mark.parametrize("pieces,stops,sent,stopped", [
    (["Hello", " wor", "ld"], ("world",), ["Hello", " ", ""], True),           # split across pieces: cut before it
    (["a", "bcXY"], ("cXY", "bc"), ["a", ""], True),                          # the earliest stop wins
    (["The ", "end", ".", " More"], ("end.",), ["The ", "", ""], True),
    (["a<", "b", "c"], ("<x",), ["a", "<b", "c"], False),                     # held while it may start a stop
    (["aaa", "a", "b"], ("aab",), ["a", "a", ""], True),                       # a prefix overlapping itself
    (["1", "2", "3"], (), ["1", "2", "3"], False),
])
def test_stop_strings(pieces, stops, sent, stopped):
    out, done = feed(StopMatcher(stops), pieces)
    assert (out, done) == (sent, stopped)


def test_no_stop_counts_before_min_tokens():
    out, done = feed(StopMatcher(("x",), min_tokens=3), ["x", "ax", "bxc"])
    assert out == ["x", "ax", "b"] and done                     # the x of tokens 1 and 2 are text
    out, done = feed(StopMatcher(("xy",), min_tokens=2), ["ax", "yb"])
    assert out == ["a", ""] and done                            # begun before min_tokens, ended at it: a stop


def test_held_back_text_is_sent_at_the_end():
    matcher = StopMatcher(("END",))
    assert matcher.add("the EN", 1) == ("the ", False)
    assert matcher.flush() == "EN"
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(("",))


def test_a_text_stream_stopped_by_a_string_split_across_tokens_and_its_streamed_pieces(tokenizer):
    text = "one two three four"
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer, tokenizer.encode("count: "), stops=("three",))
    pieces = []
    for n, token in enumerate(ids, 1):
        piece, stopped = stream.add(token, n)
        pieces.append(piece)
        if stopped:
            break
    assert "".join(pieces) == "one two " and stopped
    assert stream.finish(len(pieces)) == ("", True)
    whole = TextStream(tokenizer, [], stops=("nowhere",))
    pieces = [whole.add(t, n)[0] for n, t in enumerate(ids, 1)]
    tail, stopped = whole.finish(len(ids))
    assert "".join(pieces) + tail == text and not stopped
