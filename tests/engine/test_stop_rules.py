"""Stop rule traces: tokens arrive one at a time, each with the text it decodes to. The token-id
rules run in the scheduler (core/stop_conditions.py), stop strings in the engine's output
processor; this drives both the way one engine step does."""

from dataclasses import dataclass

import pytest

from tessera.core.core_output import EngineCoreOutput, SeqDelta
from tessera.core.stop_conditions import check_token_stop
from tessera.engine.output_processor import OutputProcessor, RequestState
from tessera.sampling.params import SamplingParams
from tessera.sequence import Sequence, SequenceStatus, new_seq_id

EOS = 2
RUNNING = SequenceStatus.RUNNING
STOPPED = SequenceStatus.FINISHED_STOPPED
CAPPED = SequenceStatus.FINISHED_LENGTH_CAPPED


class PieceTokenizer:
    """Each id decodes to the text the trace gave it."""

    def __init__(self) -> None:
        self.texts: dict[int, str] = {}

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(self.texts[i] for i in ids)


@dataclass
class Traced:
    status: SequenceStatus
    stop_reason: int | str | None
    output_text: str
    output_token_ids: list[int]

    def get_len(self) -> int:
        return len(self.output_token_ids) + 3


def run(pieces, params, max_model_len=1000, prompt_len=3, eos_text=""):
    """Feed (token_id, text) pairs until a rule stops the sequence; return it and the step."""
    tokenizer = PieceTokenizer()
    processor = OutputProcessor(tokenizer, clock=lambda: 0.0)
    prompt = list(range(10, 10 + prompt_len))
    processor.add_request(RequestState("r", None, prompt, params, arrival_time=0.0))
    seq = Sequence(seq_id=new_seq_id(), prompt_token_ids=prompt, status=RUNNING)
    text = ""
    for step, (token_id, piece) in enumerate(pieces, start=1):
        tokenizer.texts[token_id] = eos_text if token_id == EOS else piece
        seq.output_token_ids.append(token_id)
        status = check_token_stop(seq, params, max_model_len, (EOS, 99))
        done = status is not None
        if done:
            seq.status = status  # as the scheduler's set_progress does
        delta = SeqDelta(0, [token_id], [{}], seq.status.finish_reason if done else None,
                         seq.stop_reason)
        outputs, stops = processor.process([EngineCoreOutput("r", [delta], finished=done)])
        if outputs:
            text = outputs[0].outputs[0].text
        if stops:
            return Traced(STOPPED, stops[0][2], text, seq.output_token_ids), step
        if done:
            return Traced(seq.status, seq.stop_reason, text, seq.output_token_ids), step
    return Traced(seq.status, seq.stop_reason, text, seq.output_token_ids), None


def toks(*texts):
    return [(100 + i, t) for i, t in enumerate(texts)]


def test_eos_stops_without_text_or_reason():
    seq, step = run(toks("Hi", " there") + [(EOS, "")] + toks("never"), SamplingParams())
    assert (seq.status, step, seq.stop_reason, seq.output_text) == (STOPPED, 3, None, "Hi there")
    assert seq.output_token_ids[-1] == EOS  # the id stays, its text does not


def test_eos_text_is_cut_when_rendered():
    p = SamplingParams(skip_special_tokens=False)
    seq, _ = run(toks("Hi") + [(EOS, "")], p, eos_text="<|im_end|>")
    assert seq.output_text == "Hi" and seq.status is STOPPED


def test_any_of_several_eos_ids():
    seq, step = run(toks("a") + [(99, "")], SamplingParams())
    assert step == 2 and seq.status is STOPPED


def test_ignore_eos_runs_to_max_tokens():
    p = SamplingParams(ignore_eos=True, max_tokens=4)
    seq, step = run(toks("a") + [(EOS, "")] + toks("b", "c", "d"), p)
    assert (seq.status, step, seq.stop_reason) == (CAPPED, 4, None)


@pytest.mark.parametrize(("include", "text"), [(False, "ab"), (True, "ab<end>")])
def test_stop_token_ids(include, text):
    p = SamplingParams(stop_token_ids=[7], include_stop_str_in_output=include)
    seq, step = run(toks("a", "b") + [(7, "<end>")] + toks("c"), p)
    assert (seq.status, step, seq.stop_reason, seq.output_text) == (STOPPED, 3, 7, text)


@pytest.mark.parametrize(("include", "text"), [(False, "Hello "), (True, "Hello world")])
def test_stop_string_across_tokens(include, text):
    p = SamplingParams(stop=["world"], include_stop_str_in_output=include)
    seq, step = run(toks("Hel", "lo wo", "rld! more", "x"), p)
    assert (seq.status, step, seq.stop_reason, seq.output_text) == (STOPPED, 3, "world", text)


def test_earliest_stop_string_wins():
    p = SamplingParams(stop=["cd", "b"])
    seq, _ = run(toks("a", "bcd"), p)
    assert (seq.stop_reason, seq.output_text) == ("b", "a")
    # "b" is old text when first checked (min_tokens): only a match overlapping "d" counts
    seq, _ = run(toks("abc", "d"), SamplingParams(stop=["cd", "b"], min_tokens=2))
    assert (seq.stop_reason, seq.output_text) == ("cd", "ab")


def test_stop_string_in_the_first_piece():
    seq, step = run(toks("STOP now"), SamplingParams(stop="STOP"))
    assert (step, seq.output_text, seq.stop_reason) == (1, "", "STOP")


def test_min_tokens_delays_stops_but_not_length_caps():
    p = SamplingParams(min_tokens=3, stop=["STOP"], stop_token_ids=[7])
    seq, step = run(toks("STOP") + [(EOS, ""), (7, "")] + toks("a", "b"), p)
    # nothing stops before 3 outputs; the 3rd is stop id 7
    assert (step, seq.stop_reason) == (3, 7)
    # a stop string written before min_tokens is not found later (its text is not new)
    seq, step = run(toks("STOP", "a", "b", "c"), SamplingParams(min_tokens=3, stop="STOP",
                                                              max_tokens=4))
    assert (seq.status, step, seq.output_text) == (CAPPED, 4, "STOPabc")
    # max_model_len still caps inside min_tokens
    seq, step = run(toks("a", "b", "c"), SamplingParams(min_tokens=10, max_tokens=20),
                    max_model_len=5)
    assert (seq.status, step) == (CAPPED, 2)


def test_length_caps():
    seq, step = run(toks(*"abcdefgh"), SamplingParams(max_tokens=5))
    assert (seq.status, step, seq.output_text) == (CAPPED, 5, "abcde")
    seq, step = run(toks(*"abcdefgh"), SamplingParams(max_tokens=None), max_model_len=7)
    assert (seq.status, step, seq.get_len()) == (CAPPED, 4, 7)


def test_stop_beats_length_on_the_same_token():
    seq, _ = run(toks("a") + [(EOS, "")], SamplingParams(max_tokens=2))
    assert seq.status is STOPPED
    seq, _ = run(toks("a", "xEND"), SamplingParams(max_tokens=2, stop="END"))
    assert (seq.status, seq.output_text) == (STOPPED, "ax")


def test_held_back_text_is_searched_when_it_arrives():
    # a token that adds no text (detokenizer holding bytes) cannot match; the next one can
    seq, step = run(toks("ab", "", "cd"), SamplingParams(stop="bc"))
    assert (step, seq.output_text) == (3, "a")
