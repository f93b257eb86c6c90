"""`mlxcel split-mtp` and standalone `qwen3_5_mtp` drafter directories, through the real CLI and server."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from safetensors import safe_open

from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.testing.checkpoints import build_checkpoint
from tests.server.conftest import cli, mlxcel, refused, running_server

PROMPTS = ["def wrap(text, width=70):", "class Template:"]


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mtp_checkpoint(tmp_path_factory.mktemp("split") / "qwen35-partial", drafter="aligned",
                                context_scale=0.05)


def _split(raw: Path, out: Path, *extra: str, tensors: int = 15, process: bool = False) -> None:
    """`mlxcel split-mtp`: its entry point (:func:`mlxcel.cli.main`, what the console script calls) in this
    process, or with *process* the console script end to end (what a new interpreter adds is its imports)."""
    argv = ["split-mtp", "-m", str(raw), "-o", str(out), *extra]
    if process:
        result = mlxcel(*argv)
        status, stderr = result.returncode, result.stderr
    else:
        status, stderr = cli(*argv)
    assert status == 0, stderr
    assert f"wrote {tensors} tensors" in stderr  # progress and the result, for a person


@pytest.fixture(scope="module")
def head(raw: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """*raw*'s head split out with K = 2, by the console script: what every test that serves such a head reads
    (none writes to it)."""
    out = tmp_path_factory.mktemp("split-head") / "qwen35-partial-MTP"
    _split(raw, out, "--block-size", "2", process=True)
    return out


@pytest.fixture(scope="module")
def converted(raw: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """*raw* converted by mlx-lm's own converter (which drops the head), once per kind ("4bit", "8bit",
    "bf16") for the module: the tests only read the conversions."""
    from mlx_lm import convert

    root = tmp_path_factory.mktemp("converted")
    made: dict[str, Path] = {}

    def conversion(kind: str) -> Path:
        if kind not in made:
            out = root / f"qwen35-partial-{kind}"
            if kind == "bf16":
                convert(str(raw), mlx_path=str(out), dtype="bfloat16")
            else:
                convert(str(raw), mlx_path=str(out), quantize=True, q_bits=int(kind.removesuffix("bit")),
                        q_group_size=32)
            made[kind] = out
        return made[kind]

    return conversion


async def _run(argv: list[str]) -> tuple[list[dict[str, object]], dict[str, object]]:
    # Every run starts cold: the prompt cache's disk tier would resume one run's prompts from the last's,
    # and a prompt resumed after a restart drafts from its second step (the drafter's state stays in memory).
    async with running_server([*argv, "--prompt-cache-disk-bytes", "0"]) as url, \
            httpx.AsyncClient(timeout=60) as client:
        bodies = [(await client.post(f"{url}/v1/completions", json={
            "prompt": p, "max_tokens": 40, "temperature": 0})).json() for p in PROMPTS]
        policy = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
    return bodies, policy


async def _probed(argv: list[str]) -> dict[str, object]:
    """The MTP policy a server of *argv* boots into, read once it is ready: what the exactness probe said
    (decided at load; the tests read nothing else of such a run, so it decodes nothing)."""
    async with running_server(argv) as url, httpx.AsyncClient(timeout=60) as client:
        policy: dict[str, object] = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
    return policy


@pytest.mark.slow
async def test_a_split_head_drafts_exactly_as_the_in_checkpoint_one(raw: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    head = tmp_path / "qwen35-partial-MTP"
    _split(raw, head, "--block-size", "3")
    config = json.loads((head / "config.json").read_text())
    assert (config["model_type"], config["block_size"]) == ("qwen3_5_mtp", 3)
    with safe_open(str(head / "model.safetensors"), "np") as f:
        names = set(f.keys())
        norm = f.get_tensor("norm.weight")
    with safe_open(str(raw / "model.safetensors"), "np") as f:
        raw_norm = f.get_tensor("mtp.norm.weight")
    assert len(names) == 15 and not any(n.startswith("mtp.") for n in names)
    assert (norm == raw_norm + 1.0).all()  # the split layout is the model's own: zero-centred norms shifted

    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")
    inside, _ = await _run(["--model", str(raw), "--mtp", "--draft-block-size", "3"])
    split, policy = await _run(["--model", str(raw), "--draft-model", str(head)])  # K from the head's config
    assert (policy["drafter"], policy["block_size"]) == ("qwen35-partial-MTP", 3)
    for a, b in zip(inside, split, strict=True):
        assert a["choices"] == b["choices"]  # type: ignore[index]
        # The same drafts, accepted the same way: the same head, not merely the same text.
        assert a["timings"]["draft_n_accepted"] == b["timings"]["draft_n_accepted"] > 0  # type: ignore[index]
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "0")
    classic, _ = await _run(["--model", str(raw), "--draft-model", str(head)])
    assert [b["choices"] for b in classic] == [b["choices"] for b in split]  # temperature 0: byte identity


@pytest.mark.slow
def test_split_mtp_refuses_clearly(raw: Path, tmp_path: Path) -> None:
    llama = build_checkpoint(tmp_path / "llama-tiny", "llama")
    stripped = tmp_path / "qwen35-converted"
    build_mtp_checkpoint(stripped, drafter="aligned", context_scale=0.05)
    with safe_open(str(stripped / "model.safetensors"), "np") as f:
        names = f.keys()  # a safe_open handle is not itself iterable
        kept = {k: f.get_tensor(k) for k in names if not k.startswith("mtp.")}
    from safetensors.numpy import save_file

    save_file(kept, str(stripped / "model.safetensors"))
    cases = [
        (["-m", str(llama), "-o", str(tmp_path / "a")], "is a 'llama' checkpoint; split-mtp extracts the MTP head"),
        (["-m", str(stripped), "-o", str(tmp_path / "b")],
         "was converted without its MTP layer; use the raw checkpoint"),
        (["-m", str(raw), "-o", str(llama)], "already holds a checkpoint (it has a config.json); pass --force"),
        (["-m", str(raw), "-o", str(tmp_path / "c"), "--block-size", "1"], "--block-size"),
        (["-m", str(raw), "-o", str(raw), "--force"], "the output directory is the source checkpoint"),
    ]
    for argv, expected in cases:
        (line,) = refused(*argv, command="split-mtp").strip().splitlines()
        assert line.startswith("mlxcel split-mtp: ") and expected in line, line
    assert json.loads((llama / "config.json").read_text())["model_type"] == "llama"  # untouched


@pytest.mark.slow
def test_a_directory_that_is_not_a_head_is_refused_at_startup(raw: Path, head: Path, tmp_path: Path) -> None:
    extra = tmp_path / "extra"
    shutil.copytree(head, extra)
    with safe_open(str(head / "model.safetensors"), "np") as f:
        names = f.keys()
        tensors = {k: f.get_tensor(k) for k in names}
    from safetensors.numpy import save_file

    save_file({**tensors, "lm_head.weight": tensors["fc.weight"]}, str(extra / "model.safetensors"))
    other = tmp_path / "other"
    shutil.copytree(head, other)
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (other / "model.safetensors").unlink()
    for directory, expected in [(extra, "does not look like a standalone qwen3_5_mtp head (16 tensors; "
                                         "unexpected: lm_head.weight)"),
                                (other, "does not look like a standalone qwen3_5_mtp head: its config.json says "
                                        "model_type 'llama'")]:
        assert expected in refused("--model", str(raw), "--draft-model", str(directory)), directory


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
async def test_a_quantized_conversion_serves_the_burst_with_the_split_head(
        head: Path, converted: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        bits: int) -> None:
    """mlx-lm's own converter drops the head (as community conversions do); the split head brings it back.
    Whatever the probe says of a quantized verify here, the server says it and stays right."""
    quantized = converted(f"{bits}bit")
    assert json.loads((quantized / "config.json").read_text())["quantization"]["bits"] == bits
    assert "converted without its MTP layer" in refused("-m", str(quantized), "-o", str(tmp_path / "nothing"),
                                                        command="split-mtp")

    probed = await _probed(["--model", str(quantized), "--draft-model", str(head)])  # what the probe says
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")
    on, _ = await _run(["--model", str(quantized), "--draft-model", str(head)])
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "0")
    off, _ = await _run(["--model", str(quantized), "--draft-model", str(head)])
    if probed["state"] != "exactness_declined":  # the quantized verify is exact on this machine
        assert all(b["timings"]["draft_rounds"] > 0 for b in on)  # type: ignore[index]
        assert [b["choices"] for b in on] == [b["choices"] for b in off]
    else:  # vetoed: said in the body, and even pinned on, classic decode serves
        assert isinstance(probed["decline_detail"], str)
        assert all(b["timings"]["draft_rounds"] == 0 for b in on)  # type: ignore[index]


@pytest.mark.slow
async def test_a_bf16_checkpoint_serves_correctly_on_the_cpu_and_says_it_is_slow(
        head: Path, converted: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import logging

    bf16 = converted("bf16")
    with caplog.at_level(logging.WARNING, logger="mlxcel"):  # said as the weights load
        probed = await _probed(["--model", str(bf16), "--draft-model", str(head)])
    slow = [r.getMessage() for r in caplog.records if "bfloat16 weights" in r.getMessage()]
    assert len(slow) == 1 and "slower than float32" in slow[0]
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")
    on, _ = await _run(["--model", str(bf16), "--draft-model", str(head)])
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "0")
    off, _ = await _run(["--model", str(bf16), "--draft-model", str(head)])
    assert all(b["choices"][0]["text"] for b in off)  # type: ignore[index]
    if probed["state"] != "exactness_declined":
        assert all(b["timings"]["draft_rounds"] > 0 for b in on)  # type: ignore[index]
        assert [b["choices"] for b in on] == [b["choices"] for b in off]


@pytest.mark.slow
@pytest.mark.parametrize("bits", ["4", "8"])
async def test_a_drafter_quantized_at_load_drafts_and_the_text_stays_classic(
        raw: Path, monkeypatch: pytest.MonkeyPatch, bits: str) -> None:
    monkeypatch.setenv("MLXCEL_DRAFT_BLOCK_SIZE", "2")
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")
    quantized, _ = await _run(["--model", str(raw), "--mtp", "--draft-quantize", bits])
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "0")
    classic, _ = await _run(["--model", str(raw), "--mtp", "--draft-quantize", bits])
    assert all(b["timings"]["draft_n_accepted"] > 0 for b in quantized)  # type: ignore[index]  # it drafts
    assert [b["choices"] for b in quantized] == [b["choices"] for b in classic]  # drafts never change the text


def _as_qwen3_8(checkpoint: Path, gate: str = "SiLU") -> None:
    """Qwen 3.8's config keys on a tiny Qwen 3.5 checkpoint (same tensors, as the 27B's key set is; untied head)."""
    config = json.loads((checkpoint / "config.json").read_text())
    text = config["text_config"]
    text["output_gate_type"] = gate
    text["rope_parameters"]["mrope_interleaved"] = True
    config.update(language_model_only=True, vision_start_token_id=2, tie_word_embeddings=False)
    assert text["tie_word_embeddings"] is False
    (checkpoint / "config.json").write_text(json.dumps(config, indent=2))


@pytest.mark.slow
async def test_a_qwen3_8_shaped_checkpoint_serves_with_its_head(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_mtp_checkpoint(tmp_path / "qwen38-tiny", drafter="aligned", context_scale=0.05)
    _as_qwen3_8(model)
    monkeypatch.setenv("MLXCEL_DRAFT_BLOCK_SIZE", "2")
    profiling = await _probed(["--model", str(model), "--mtp"])
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")
    on, _ = await _run(["--model", str(model), "--mtp"])
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "0")
    off, _ = await _run(["--model", str(model), "--mtp"])
    assert (profiling["target"], profiling["drafter"], profiling["block_size"]) == (
        "qwen38-tiny", "qwen38-tiny#mtp", 2)
    assert profiling["state"] in ("profiling", "exactness_declined")  # the key set is accepted either way
    if profiling["state"] == "profiling":
        assert all(b["timings"]["draft_rounds"] > 0 for b in on)  # type: ignore[index]
    assert [b["choices"] for b in on] == [b["choices"] for b in off]


@pytest.mark.slow
def test_an_output_gate_mlx_lm_does_not_compute_is_refused(tmp_path: Path) -> None:
    model = build_mtp_checkpoint(tmp_path / "qwen38-relu", drafter="aligned")
    _as_qwen3_8(model, gate="relu")
    stderr = refused("--model", str(model), "--mtp")
    assert "output_gate_type 'relu'" in stderr and "is not supported" in stderr


@pytest.mark.slow
async def test_a_qwen3_6_moe_target_serves_the_burst_with_its_moe_head(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen 3.6 (``qwen3_5_moe``): MoE MLPs in the target and in its head, experts stored fused as Hugging
    Face stores them. The probe checks the verify (routing included) at every width; the head, split out or
    read in place, drafts the same."""
    moe = build_mtp_checkpoint(tmp_path / "qwen36-moe-tiny", drafter="aligned", context_scale=0.05, moe=True)
    head = tmp_path / "qwen36-moe-tiny-MTP"
    _split(moe, head, "--block-size", "3", tensors=20)  # router, shared expert and its gate, 3 stacked experts
    monkeypatch.setenv("MLXCEL_DRAFT_BLOCK_SIZE", "3")
    probed = await _probed(["--model", str(moe), "--mtp"])
    assert (probed["target"], probed["drafter"], probed["block_size"]) == (
        "qwen36-moe-tiny", "qwen36-moe-tiny#mtp", 3)
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")
    inside, _ = await _run(["--model", str(moe), "--mtp"])
    split, _ = await _run(["--model", str(moe), "--draft-model", str(head)])
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "0")
    classic, _ = await _run(["--model", str(moe), "--mtp"])
    assert [b["choices"] for b in inside] == [b["choices"] for b in classic] == [b["choices"] for b in split]
    if probed["state"] == "profiling":  # exact here: the burst ran, and both heads drafted alike
        accepted = [[b["timings"]["draft_n_accepted"] for b in run] for run in (inside, split)]  # type: ignore[index]
        assert accepted[0] == accepted[1]
        assert all(b["timings"]["draft_n_accepted"] > 0 for b in inside)  # type: ignore[index]
    else:
        assert probed["state"] == "exactness_declined" and isinstance(probed["decline_detail"], str)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["split head", "4-bit target", "bf16 target", "qwen3.8", "qwen3.6 moe"])
async def test_every_variant_profiles_settles_and_names_its_pairing(
        raw: Path, head: Path, converted: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        variant: str) -> None:
    """The policy lifecycle for each way the Qwen line is downloaded: profiling, two samples, settled, persisted."""
    import os

    if variant == "split head":
        argv, target, drafter = ["--model", str(raw), "--draft-model", str(head)], raw.name, head.name
    elif variant in ("4-bit target", "bf16 target"):
        target_dir = converted("4bit" if variant == "4-bit target" else "bf16")
        argv, target, drafter = ["--model", str(target_dir), "--draft-model", str(head)], target_dir.name, head.name
    else:
        model = build_mtp_checkpoint(tmp_path / variant.replace(" ", "-"), drafter="aligned", context_scale=0.05,
                                     moe=variant == "qwen3.6 moe")
        if variant == "qwen3.8":
            _as_qwen3_8(model)
        argv, target, drafter = ["--model", str(model), "--mtp"], model.name, f"{model.name}#mtp"
    monkeypatch.setenv("MLXCEL_MTP_PROFILE_SAMPLES", "2")
    monkeypatch.setenv("MLXCEL_DRAFT_BLOCK_SIZE", "2")
    async with running_server(argv) as url, httpx.AsyncClient(timeout=60) as client:
        before = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
        for prompt in PROMPTS:
            await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 40, "temperature": 0})
        after = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
    assert (before["target"], before["drafter"], before["block_size"]) == (target, drafter, 2)
    if before["state"] == "exactness_declined":  # this machine's kernels: said, and nothing to profile
        assert after["state"] == "exactness_declined"
        return
    assert (before["state"], before["samples_remaining"]) == ("profiling", 2)
    assert (after["state"], after["samples"]) == ("settled", 2) and after["verdict"] in ("enable", "decline")
    assert list((Path(os.environ["MLXCEL_CACHE_DIR"]) / "mtp-policy").glob("*.json"))  # persisted
