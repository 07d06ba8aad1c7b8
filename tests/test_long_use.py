"""Long use leaks nothing: many generations and a long chat with context drops in one process keep the
same open files and threads, and failed loads of broken files release what they opened.
(The full-size run with the bundled model, RSS measured: benchmarks/long_use.py → results/long-use.json.)"""
import gc
import threading

import psutil

from edgellm.loading import load_model


def handles():
    gc.collect()
    p = psutil.Process()
    maps = sum(1 for m in p.memory_maps(grouped=False) if m.path.endswith((".gguf", ".safetensors")))
    return {"fds": p.num_fds(), "threads": p.num_threads(), "py_threads": threading.active_count(), "model_maps": maps}


def test_many_generations_and_a_long_chat_leak_nothing(tiny_llama, tmp_path):
    from edgellm.args import engine_from_args, sampling_from_args
    from edgellm.cli import build_parser, prompt_ids
    from edgellm.generate import Done, GenerationSettings
    from edgellm.tui.history import Conversation, Message, load_conversation, save_conversation
    from edgellm.tui.session import ChatSession, ChatSettings

    loaded = load_model(tiny_llama[1], max_seq_len=128)
    words = "the quick brown fox jumps over the lazy dog and a language model predicts the next token".split()

    def one_run(i):
        args = build_parser().parse_args(["run", " ".join(words[i % 7:]), "-n", "6", "--temperature", "0.8",
                                          "--seed", str(i), "--ctx", "128"])
        engine = engine_from_args(args, loaded)
        events = list(engine.generate(prompt_ids(args, loaded.tokenizer, args.prompt),
                                      GenerationSettings(max_tokens=6, sampling=sampling_from_args(args))))
        assert isinstance(events[-1], Done)

    for i in range(5):  # warm-up: lazily built kernels and thread pools
        one_run(i)
    before = handles()
    for i in range(60):
        one_run(i)
    assert handles() == before

    args = build_parser().parse_args(["run", "x", "--ctx", "128"])
    session = ChatSession(engine_from_args(args, loaded), loaded.tokenizer,
                          ChatSettings(temperature=0.8, seed=1, max_tokens=12))
    conv = Conversation(system="Be brief.")
    history = tmp_path / "chat.json"
    dropped = 0
    for turn_no in range(60):
        conv.messages.append(Message("user", " ".join(words[turn_no % 5: turn_no % 5 + 8])))
        turn = session.prepare(conv)
        assert turn.error is None and len(turn.ids) + turn.max_tokens <= 128
        dropped += turn.dropped
        done = [e for e in session.generate(turn, threading.Event()) if isinstance(e, Done)][0]
        session.record_answer(conv, done.text, done.tokens, done.stats)
        save_conversation(conv, history)
        if turn_no == 4:
            before = handles()
    assert dropped > 20 and conv.context_start > 0  # the context filled and old turns were dropped
    assert handles() == before
    assert len(load_conversation(history).messages) == 120
    assert [p.name for p in tmp_path.iterdir()] == ["chat.json"]


def test_failed_loads_release_what_they_opened(tiny_llama, tmp_path):
    from tests.fuzz_cases import all_cases, run_case, sample

    cases = sample([c for c in all_cases({"llama_gqa": tiny_llama}, 3, 5) if c.must_fail], 150, 3)
    run_case(cases[0], tmp_path / "w", generate=False)
    before = handles()
    for c in cases:
        outcome = run_case(c, tmp_path / "w", generate=False)
        assert outcome.result == "refused", outcome
    assert handles() == before
