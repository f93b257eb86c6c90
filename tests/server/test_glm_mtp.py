"""GLM-4.7-Flash (``glm4_moe_lite``): `mlxcel split-mtp` through the real CLI, then the burst served over HTTP.

The raw checkpoint is transformers' own model with the next-token layer at
``model.layers.{N}.*`` in the raw names, sharded with an index
(:mod:`mlxcel.families.glm4_moe_lite.tiny`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from mlxcel.families.glm4_moe_lite.tiny import build_glm_checkpoint
from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.testing.checkpoints import build_checkpoint
from tests.server.conftest import b1_verdict, cli, mlxcel, refused, running_server

PROMPTS = ["def wrap(text, width=70):", "class Template:"]


def _split(raw: Path, out: Path, *extra: str) -> str:
    """``mlxcel split-mtp`` in this process (:func:`~tests.server.conftest.cli`): its stderr. Splitting touches
    nothing process-wide; the first test below runs the command in a process of its own."""
    status, stderr = cli("split-mtp", "-m", str(raw), "-o", str(out), *extra)
    assert status == 0, stderr
    return stderr


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("glm")
    raw = build_glm_checkpoint(root / "glm-partial", drafter="aligned", context_scale=0.05)
    random = build_glm_checkpoint(root / "glm-random", drafter="random", seed=1)
    _split(raw, root / "glm-partial-MTP")
    _split(random, root / "glm-random-MTP")
    return {"raw": raw, "head": root / "glm-partial-MTP", "random": random, "random-head": root / "glm-random-MTP"}


async def _run(argv: list[str], prompts: list[str] = PROMPTS, max_tokens: int = 40,
               ) -> tuple[list[dict[str, object]], dict[str, object]]:
    async with running_server(argv) as url, httpx.AsyncClient(timeout=120) as client:
        bodies = []
        for prompt in prompts:
            response = await client.post(f"{url}/v1/completions", json={
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
            assert response.status_code == 200, response.text
            bodies.append(response.json())
        policy = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
    return bodies, policy


def _choices(bodies: list[dict[str, object]]) -> list[object]:
    return [b["choices"] for b in bodies]


def _timings(bodies: list[dict[str, object]], key: str) -> list[int]:
    return [b["timings"][key] for b in bodies]  # type: ignore[index]


@pytest.mark.slow
def test_split_mtp_writes_the_layer_in_the_drafters_layout(glm: dict[str, Path], tmp_path: Path) -> None:
    raw = glm["raw"]
    (raw / "model-00001-of-00003.safetensors").rename(tmp_path / "moved")  # a shard without the layer: never opened
    try:  # the command itself, in a process of its own, as a user runs it
        result = mlxcel("split-mtp", "-m", str(raw), "-o", str(tmp_path / "out"), "--block-size", "3")
        assert result.returncode == 0, result.stderr
        log = result.stderr
    finally:
        (tmp_path / "moved").rename(raw / "model-00001-of-00003.safetensors")
    assert "from 2 shard(s): model-00002-of-00003.safetensors, model-00003-of-00003.safetensors" in log
    assert "copied 45/45 source tensors" in log  # progress while copying, and the end of it
    assert "wrote 24 tensors" in log and "block_size 3" in log
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["block_size"], config["tie_word_embeddings"]) == (
        "glm4_moe_lite_mtp", 3, False)
    assert config["text_config"]["model_type"] == "glm4_moe_lite" and "quantization" not in config
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert json.loads((glm["head"] / "config.json").read_text())["block_size"] == 2  # nextn + 1 by default

    raw_tensors = {**load_file(str(raw / "model-00002-of-00003.safetensors")),
                   **load_file(str(raw / "model-00003-of-00003.safetensors"))}
    split = load_file(str(tmp_path / "out" / "model.safetensors"))
    layer = "model.layers.2."
    assert (split["lm_head.weight"] == raw_tensors[layer + "shared_head.head.weight"]).all()
    assert (split["model.shared_head_norm.weight"] == raw_tensors[layer + "shared_head.norm.weight"]).all()
    # kv_b_proj (heads x (nope + v), rank) -> embed_q (heads, rank, nope) and unembed_out (heads, v, rank)
    kv_b = raw_tensors[layer + "self_attn.kv_b_proj.weight"].reshape(4, 32, 32)
    assert (split["model.mtp_block.self_attn.embed_q.weight"] == kv_b[:, :16, :].transpose(0, 2, 1)).all()
    assert (split["model.mtp_block.self_attn.unembed_out.weight"] == kv_b[:, 16:, :]).all()
    for expert in (0, 7):  # stacked in expert order
        assert (split["model.mtp_block.mlp.switch_mlp.down_proj.weight"][expert]
                == raw_tensors[f"{layer}mlp.experts.{expert}.down_proj.weight"]).all()


@pytest.mark.slow
async def test_temperature_zero_mtp_is_byte_identical_at_k2_and_k3(glm: dict[str, Path], tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    raw, head = glm["raw"], glm["head"]
    quantized = tmp_path / "glm-partial-MTP-4bit"
    assert "4-bit group 32" in _split(raw, quantized, "--q-bits", "4", "--q-group-size", "32")
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "0")
    classic, _ = await _run(["--model", str(raw), "--draft-model", str(head)])
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")
    for argv, k in [([], 2), (["--draft-block-size", "3"], 3)]:
        on, policy = await _run(["--model", str(raw), "--draft-model", str(head), *argv])
        assert (policy["drafter"], policy["block_size"], policy["state"]) == ("glm-partial-MTP", k, "forced")
        assert _choices(on) == _choices(classic)
        assert all(n > 0 for n in _timings(on, "draft_n_accepted"))  # the burst ran, and its drafts were kept
    on, policy = await _run(["--model", str(raw), "--draft-model", str(quantized)])
    assert policy["drafter"] == "glm-partial-MTP-4bit"
    assert _choices(on) == _choices(classic) and all(n > 0 for n in _timings(on, "draft_rounds"))


@pytest.mark.slow
async def test_an_adopted_prompt_prefix_and_the_burst_combine(glm: dict[str, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefix cache hands the target its cache; the drafter catches up on the rest of the prompt
    (a whole-prompt hit: from the first classic step). Its own cache then lacks the adopted part,
    which costs acceptance only: the verify decides the text."""
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[0] + "\n    return text"]
    argv = ["--model", str(glm["raw"]), "--draft-model", str(glm["head"])]
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")
    on, _ = await _run(argv, prompts)
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "0")
    off, _ = await _run(argv, prompts)
    assert _timings(on, "cached_n")[0] == 0 and all(n > 0 for n in _timings(on, "cached_n")[1:])
    assert all(n > 0 for n in _timings(on, "draft_rounds"))
    assert _choices(on) == _choices(off)


@pytest.mark.slow
async def test_the_policy_profiles_settles_restores_and_declines_a_random_drafter(
        glm: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXCEL_MTP_PROFILE_SAMPLES", "2")
    argv = ["--model", str(glm["raw"]), "--draft-model", str(glm["head"])]
    async with running_server(argv) as url, httpx.AsyncClient(timeout=120) as client:
        before = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
        for prompt in PROMPTS:
            await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 40, "temperature": 0})
        settled = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
    assert (before["state"], before["samples_remaining"], before["target"], before["drafter"],
            before["block_size"]) == ("profiling", 2, "glm-partial", "glm-partial-MTP", 2)
    assert (settled["state"], settled["samples"]) == ("settled", 2) and settled["verdict"] in ("enable", "decline")
    assert list((Path(os.environ["MLXCEL_CACHE_DIR"]) / "mtp-policy").glob("*.json"))  # persisted
    _, restored = await _run(argv, prompts=[])
    assert b1_verdict(restored) == b1_verdict(settled)

    _, policy = await _run(["--model", str(glm["random"]), "--draft-model", str(glm["random-head"])],
                                prompts=[f"{p} # {i}" for i in range(2) for p in PROMPTS], max_tokens=32)
    assert (policy["state"], policy["verdict"], policy["mtp_enabled"]) == ("settled", "decline", False)
    assert policy["acceptance_rate"] <= 0.1  # type: ignore[operator]
    assert policy["drafter"] == "glm-random-MTP"


@pytest.mark.slow
async def test_a_glm_batch_speculates_and_its_text_is_classic_decodes(glm: dict[str, Path],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """GLM-4.7-Flash inside the continuous batch: five requests for three places, of different lengths (rows
    join a speculating batch and leave it mid-way); at temperature 0 each text is the one MTP-off gives."""
    from tests.server.test_batch_mtp import _at_once, _steps

    prompts = [*PROMPTS, "import os\n", "for i in range(10):", "x = ["]
    requests: list[dict[str, object]] = [{"prompt": p, "max_tokens": 16 + 7 * i, "temperature": 0}
                                         for i, p in enumerate(prompts)]
    argv = ["--model", str(glm["raw"]), "--draft-model", str(glm["head"]), "--parallel", "3", "--metrics",
            "--prompt-cache-size", "0"]
    texts, batches = {}, {}
    for pin in ("0", "1"):
        monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", pin)
        async with running_server(argv) as url, httpx.AsyncClient(timeout=120) as client:
            bodies = await _at_once(url, requests, stagger=0.02)
            batches[pin] = (await client.get(f"{url}/v1/internal/mtp-policy")).json()["batch"]
            steps = await _steps(url)
        texts[pin] = [b["choices"][0]["text"] for b in bodies]  # type: ignore[index]
    assert texts["1"] == texts["0"]
    assert batches["1"]["speculates"] is True and batches["0"]["speculates"] is False
    assert sum(n for k, n in steps.items() if k != "0") > 0, steps  # the pinned server's batch drafted


@pytest.mark.slow
def test_split_mtp_refuses_clearly(glm: dict[str, Path], tmp_path: Path) -> None:
    raw = glm["raw"]
    converted = build_glm_checkpoint(tmp_path / "glm-converted", nextn=False)
    quantized = build_glm_checkpoint(tmp_path / "glm-prequantized")
    shard = quantized / "model-00003-of-00003.safetensors"
    tensors = load_file(str(shard))
    name = next(n for n in sorted(tensors) if n.endswith(".weight") and tensors[n].ndim == 2)
    save_file({**tensors, name.replace(".weight", ".scales"): tensors[name][:, :2]}, str(shard))
    index = json.loads((quantized / "model.safetensors.index.json").read_text())
    index["weight_map"][name.replace(".weight", ".scales")] = shard.name
    (quantized / "model.safetensors.index.json").write_text(json.dumps(index))
    llama = build_checkpoint(tmp_path / "llama-tiny", "llama")
    crowded = tmp_path / "crowded"
    crowded.mkdir()
    (crowded / "model-00001-of-00002.safetensors").write_bytes(b"someone's weights")
    qwen = build_mtp_checkpoint(tmp_path / "qwen35", drafter="aligned")
    cases = [
        (["-m", str(converted), "-o", str(tmp_path / "a")],
         "has no model.layers.2.* tensors: it was converted without its MTP layer; use the raw zai-org checkpoint"),
        (["-m", str(quantized), "-o", str(tmp_path / "b")], "is already quantized (F32)"),
        (["-m", str(llama), "-o", str(tmp_path / "c")], "is a 'llama' checkpoint; split-mtp extracts the MTP head"),
        (["-m", str(raw), "-o", str(llama)], "already holds a checkpoint (it has a config.json); pass --force"),
        (["-m", str(raw), "-o", str(crowded), "--force"], "holds other weights (model-00001-of-00002.safetensors)"),
        (["-m", str(raw), "-o", str(tmp_path / "d"), "--block-size", "1"], "--block-size"),
        (["-m", str(raw), "-o", str(tmp_path / "e"), "--block-size", "33"], "--block-size"),
        (["-m", str(raw), "-o", str(tmp_path / "f"), "--q-bits", "7"], "--q-bits: invalid choice: 7"),
        (["-m", str(raw), "-o", str(tmp_path / "g"), "--q-bits", "4", "--q-group-size", "48"],
         "--q-group-size: invalid choice: 48"),
        (["-m", str(qwen), "-o", str(tmp_path / "h"), "--q-bits", "4"], "--q-bits quantizes GLM-4.7-Flash's"),
    ]
    for argv, expected in cases:
        stderr = refused(*argv, command="split-mtp")
        line = stderr.strip().splitlines()[-1]  # after any progress lines: one line saying why
        assert line.startswith("mlxcel split-mtp: ") and expected in line and "Traceback" not in stderr, line
    assert json.loads((llama / "config.json").read_text())["model_type"] == "llama"  # untouched
    assert (crowded / "model-00001-of-00002.safetensors").read_bytes() == b"someone's weights"


@pytest.mark.slow
def test_a_glm_target_needs_a_split_drafter(glm: dict[str, Path], tmp_path: Path) -> None:
    raw, head = glm["raw"], glm["head"]
    extra = tmp_path / "extra"
    extra.mkdir()
    with safe_open(str(head / "model.safetensors"), "np") as f:
        names = f.keys()
        tensors = {k: f.get_tensor(k) for k in names}
    save_file({**tensors, "model.layers.0.mlp.gate.weight": tensors["model.mtp_block.mlp.gate.weight"]},
              str(extra / "model.safetensors"))
    (extra / "config.json").write_text((head / "config.json").read_text())
    qwen = build_mtp_checkpoint(tmp_path / "qwen35", drafter="aligned")
    _split(qwen, tmp_path / "qwen35-MTP")
    for argv, expected in [
        (["--mtp"], "next-token layer is served from its own directory: `mlxcel split-mtp"),
        (["--draft-model", str(raw)], "does not look like a standalone glm4_moe_lite_mtp head: its config.json "
                                      "says model_type 'glm4_moe_lite'"),
        (["--draft-model", str(extra)], "does not look like a standalone glm4_moe_lite_mtp head (25 tensors; "
                                        "unexpected: model.layers.0.mlp.gate.weight)"),
        (["--draft-model", str(tmp_path / "qwen35-MTP")], "is a qwen3_5_mtp head; this target needs a "
                                                           "glm4_moe_lite_mtp one"),
    ]:
        assert expected in refused("--model", str(raw), *argv), argv


@pytest.mark.slow
async def test_routing_that_sorts_only_at_the_verify_width_is_probed(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx-lm's switch MLP gathers the experts unsorted below 64 routed rows and sorted from 64 on. With 22
    of 32 experts a token, a single step routes 22 rows and a width-3 verify 66: only the verify sorts. The
    probe checks that width at boot; exact, the burst runs, else the pairing is declined and classic decode
    serves. The text is classic decode's either way."""
    raw = build_glm_checkpoint(tmp_path / "glm-sorting", drafter="aligned", context_scale=0.05,
                               text={"n_routed_experts": 32, "num_experts_per_tok": 22})
    head = tmp_path / "glm-sorting-MTP"
    _split(raw, head, "--block-size", "3")
    argv = ["--model", str(raw), "--draft-model", str(head)]
    _, probed = await _run(argv, prompts=[])
    assert probed["block_size"] == 3 and 3 * 22 >= 64 > 22
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")
    on, _ = await _run(argv)
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "0")
    off, _ = await _run(argv)
    assert _choices(on) == _choices(off)
    if probed["state"] == "exactness_declined":
        assert isinstance(probed["decline_detail"], str) and not any(_timings(on, "draft_rounds"))
    else:
        assert probed["state"] == "profiling" and all(n > 0 for n in _timings(on, "draft_rounds"))
