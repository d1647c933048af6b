"""The server's parts on their own: the step message, the scheduler, text streams and chat templates."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from shardwise.engine import SamplingParams
from shardwise.engine.slots import StepBatch
from shardwise.engine.text import DEFAULT_MODEL, load_tokenizer
from shardwise.serve.metrics import Metrics
from shardwise.serve.scheduler import EngineDown, Output, QueueFull, Scheduler, Sequence
from shardwise.serve.step import Kind, decode, encode
from shardwise.serve.text import FALLBACK_TEMPLATE, ChatTemplate, TextStream


def test_step_round_trip():
    batch = StepBatch.build([(3, 10, [7]), (0, 0, [1, 2, 3, 4]), (5, 2, [9, 8])])
    header, payload = encode(batch)
    assert header.tolist() == [1, 3, 4, 3 * 3 + 3 * 4, 0]
    back = decode(header, payload)
    for name in ("slots", "past", "n_new", "ids"):
        assert torch.equal(getattr(back, name), getattr(batch, name))
    assert back.ids.tolist() == [[0, 0, 0, 7], [1, 2, 3, 4], [0, 0, 9, 8]]
    assert back.tables is None
    with pytest.raises(ValueError, match="does not match its header"):
        decode(header, payload[:-1])
    # a paged step carries its rows' block tables (B, W)
    tables = torch.tensor([[4, 0], [1, 2], [3, 0]])
    header, payload = encode(StepBatch.build([(3, 10, [7]), (0, 0, [1, 2, 3, 4]), (5, 2, [9, 8])], tables=tables))
    assert header.tolist() == [1, 3, 4, 3 * 3 + 3 * 4 + 3 * 2, 2]
    assert torch.equal(decode(header, payload).tables, tables)
    # a step whose rows all decode greedily travels as GREEDY_STEP (engine.argmax on every rank)
    assert not decode(header, payload).greedy
    greedy = StepBatch.build([(3, 10, [7])], tables=tables[:1])
    header, payload = encode(dataclasses.replace(greedy, greedy=True))
    assert header[0] == Kind.GREEDY_STEP and decode(header, payload).greedy


def _seq(prompt, max_tokens=3, stop=(), outs=None):
    outs = [] if outs is None else outs
    return Sequence(list(prompt), max_tokens, SamplingParams(), frozenset(stop), outs.append), outs


def _logits(*tokens: int, vocab: int = 16) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()  # (B, V): argmax = token


def test_scheduler_admits_batches_and_frees_slots():
    sched = Scheduler(num_slots=2, max_queue=2, metrics=Metrics(tp=1, slots=2), max_step_tokens=4)
    a, a_out = _seq([1, 2, 3], max_tokens=2)
    b, b_out = _seq([4, 5], stop=[9])
    c, _ = _seq([6])
    for s in (a, b):
        sched.submit(s)
    with pytest.raises(QueueFull, match="--max-queue 2"):
        sched.submit(c)
    batch = sched.next_batch()  # a fits the 4-token prefill budget; b (padded to 3: 2 x 3 > 4) waits
    assert batch.slots.tolist() == [0] and batch.ids.tolist() == [[1, 2, 3]]
    assert sched.finish_step(_logits(7)) == 1 and a_out == [Output(token=7)]
    batch = sched.next_batch()  # a prefill step of b alone: a's decode row is not padded to b's prompt
    assert batch.slots.tolist() == [1] and batch.ids.tolist() == [[4, 5]]
    sched.finish_step(_logits(6))
    batch = sched.next_batch()  # a decode step of both
    assert batch.slots.tolist() == [0, 1] and batch.past.tolist() == [3, 2] and batch.ids.tolist() == [[7], [6]]
    sched.finish_step(_logits(8, 9))  # a reaches max_tokens; b samples its stop token
    assert a_out[-1] == Output(token=8, finish="length") and b_out == [Output(token=6), Output(finish="stop")]
    assert sched.next_batch() is None and sorted(sched.free) == [0, 1]
    sched.submit(c)
    sched.cancel(c)  # a client that leaves while queued never takes a slot
    assert sched.next_batch() is None


def test_a_greedy_steps_tokens_come_chosen():
    sched = Scheduler(num_slots=2, max_queue=2, metrics=Metrics(tp=1, slots=2), max_step_tokens=8)
    a, a_out = _seq([1, 2], max_tokens=2)
    sched.submit(a)
    sched.next_batch()
    assert sched.finish_step(torch.tensor([5])) == 1 and a_out == [Output(token=5)]  # (B,): the tokens themselves
    sampled, _ = _seq([3])
    sampled.sampling = SamplingParams(temperature=1.0, seed=1)
    sched.submit(sampled)
    sched.next_batch()
    with pytest.raises(RuntimeError, match="samples, but its step's tokens were chosen greedily"):
        sched.finish_step(torch.tensor([6, 7]))


def test_scheduler_failure_reaches_every_request_and_refuses_new_ones():
    sched = Scheduler(num_slots=1, max_queue=4, metrics=Metrics(tp=2, slots=1), stale_s=0.2)
    (a, a_out), (b, b_out) = _seq([1]), _seq([2])
    sched.submit(a)
    sched.submit(b)
    sched.next_batch()
    assert sched.health() == (True, "ok")
    sched.fail("rank 1 died")
    assert a_out == b_out == [Output(error="rank 1 died")]
    assert sched.health() == (False, "rank 1 died")
    with pytest.raises(EngineDown):
        sched.submit(_seq([3])[0])
    stale = Scheduler(num_slots=1, max_queue=1, metrics=Metrics(tp=1, slots=1), stale_s=0.05)
    time.sleep(0.1)
    assert not stale.health()[0] and "no step completed" in stale.health()[1]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_MODEL)


def test_text_stream_holds_back_stop_string_prefixes(tok):
    ids = tok.encode("alpha beta gamma delta").ids
    stream = TextStream(tok, ["gam"])
    shown = "".join(stream.push(t) for t in ids) + stream.finish()
    assert shown == "alpha beta " and stream.stopped
    plain = TextStream(tok, [])
    assert "".join(plain.push(t) for t in ids) + plain.finish() == tok.decode(ids)
    euro = tok.encode("€€").ids  # multi-byte characters over several byte-level tokens
    s = TextStream(tok, [])
    assert "".join(s.push(t) for t in euro) + s.finish() == "€€"


def test_chat_templates(tmp_path):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    fallback = ChatTemplate.load(DEFAULT_MODEL)
    assert fallback.source == FALLBACK_TEMPLATE and not fallback.own
    assert fallback.render(msgs) == "system: S\nuser: U\nassistant:"
    own = "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": own, "bos_token": {"content": "<s>"}}))
    t = ChatTemplate.load(tmp_path)
    assert t.own and t.render(msgs) == "<s><|system|>S<|user|>U<|assistant|>"
    strict = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be a user') }}{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "default", "template": strict}]})
    )
    with pytest.raises(ValueError, match="first message must be a user"):
        ChatTemplate.load(tmp_path).render(msgs)
