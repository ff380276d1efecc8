"""Incremental detokenization against the tokenizer's own full decode, and stop strings."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tokenmill.frontend.detokenizer import IncrementalDetokenizer, find_stop

CORPUS = [
    "héllo wörld 你好 🙂",
    "hello world, hello tokens",
    "the quick brown fox jumps over the lazy dog",
    "naïve café, 東京 and 🙂🙂 again",
]
TEXTS = [
    "héllo wörld 你好 🙂 the end",
    "你好你好 🙂 café 東京!",
    "plain ascii text, nothing special",
    "🙂",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A real byte-level BPE trained here, small enough that multi-byte characters are
    split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", clean_up_tokenization_spaces=False
    )


def stream(tokenizer, prompt_ids, output_ids, chunk=1, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    pieces = [
        detok.append(output_ids[i : i + chunk]) for i in range(0, len(output_ids), chunk)
    ]
    return detok, pieces


def test_the_fixture_splits_characters_across_tokens(tokenizer):
    ids = tokenizer.encode("你好 🙂", add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "a prompt: ", "你"])
def test_one_token_at_a_time_equals_full_decode(tokenizer, text, prompt):
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    detok, pieces = stream(tokenizer, prompt_ids, output_ids)
    assert "".join(pieces) == tokenizer.decode(output_ids) == text
    assert detok.output_text == text
    assert detok.num_chars == len(text)
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("chunk", [2, 3, 100])
def test_several_tokens_per_step(tokenizer, chunk):
    output_ids = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    detok, pieces = stream(tokenizer, [], output_ids, chunk=chunk)
    assert detok.output_text == TEXTS[1]
    assert not any("\ufffd" in p for p in pieces)


def test_special_tokens_skipped_or_kept(tokenizer):
    eos = tokenizer.eos_token_id
    output_ids = tokenizer.encode("你好", add_special_tokens=False) + [eos]
    output_ids += tokenizer.encode(" ok", add_special_tokens=False)
    skipped, _ = stream(tokenizer, [eos], output_ids, skip_special_tokens=True)
    kept, _ = stream(tokenizer, [eos], output_ids, skip_special_tokens=False)
    assert skipped.output_text == tokenizer.decode(output_ids, skip_special_tokens=True)
    assert skipped.output_text == "你好 ok"
    assert kept.output_text == tokenizer.decode(output_ids, skip_special_tokens=False)
    assert kept.output_text == "你好<eos> ok"


def run_until_stop(tokenizer, text, stop, include):
    """The engine's loop: append a token, search the new text, cut on a match."""
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    for token in tokenizer.encode(text, add_special_tokens=False):
        new_text = detok.append([token])
        found = find_stop(detok.output_text, len(new_text), stop, include)
        if found is not None:
            stop_str, length = found
            return stop_str, detok.output_text[:length]
    return None, detok.output_text


def test_stop_string_split_across_tokens_is_caught(tokenizer):
    text = "hello world, hello tokens"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    stop = "o wor"
    assert not any(stop in p for p in pieces), "the stop string should span tokens"
    assert run_until_stop(tokenizer, text, [stop], include=False) == (stop, "hell")
    assert run_until_stop(tokenizer, text, [stop], include=True) == (stop, "hello wor")


def test_multibyte_stop_string(tokenizer):
    text = "héllo wörld 你好 🙂 the end"
    found = run_until_stop(tokenizer, text, ["好 🙂"], include=False)
    assert found == ("好 🙂", "héllo wörld 你")
    assert run_until_stop(tokenizer, text, ["nope"], include=False) == (None, text)


def test_find_stop_only_reports_matches_that_end_in_new_text():
    assert find_stop("xSTOPabc", 3, ["STOP"], False) is None
    assert find_stop("xSTOPabc", 4, ["STOP"], False) == ("STOP", 1)
    assert find_stop("xSTOPabc", 0, ["c"], False) is None


def test_find_stop_overlapping_and_suffix_cases():
    # "aab" arrives one char at a time: the match starts inside older text.
    text = ""
    found = None
    for ch in "xaaab":
        text += ch
        found = find_stop(text, 1, ["aab"], False)
        if found:
            break
    assert text == "xaaab" and found == ("aab", 2)
    # Several stop strings complete in the same chunk: the one that ends first wins, then
    # the one that starts first.
    assert find_stop("xabcdefg", 8, ["abcdef", "bcd"], False) == ("bcd", 2)
    assert find_stop("xabcdefg", 8, ["cd", "bcd"], True) == ("bcd", 5)
    # A stop string that is a suffix of the text, kept.
    assert find_stop("say END", 2, ["END"], True) == ("END", 7)


def test_find_stop_rejects_negative_counts():
    with pytest.raises(ValueError, match="num_new_chars=-1"):
        find_stop("abc", -1, ["a"], False)
