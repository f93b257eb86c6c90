"""The consumer side of ``GET /v1/internal/mtp-policy``: fetch it, render it for a person.

It follows the contract's consumer rules: unknown fields are ignored; an
unknown ``state``, ``reason`` or ``verdict`` label is "no verdict I can
render", never an error; a body whose ``schema_version`` this client does not
know renders nothing; an operator pin renders as a pin, never as a measurement.
"""

from __future__ import annotations

from typing import Any

import httpx

ENDPOINT = "/v1/internal/mtp-policy"
SUPPORTED_SCHEMA_VERSION = 1
NO_VERDICT = "no verdict I can render"


class PolicyFetchError(Exception):
    """The endpoint could not be read; ``str()`` says why in one line."""


def fetch(base_url: str, api_key: str | None = None, timeout: float = 10.0, model: str | None = None) -> Any:
    """The decoded JSON body of the policy endpoint of the server at *base_url* (for *model*, on a server of
    several models; else its default model's)."""
    url = base_url.rstrip("/") + ENDPOINT
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url, headers=headers, timeout=timeout, params={"model": model} if model else None)
    except httpx.HTTPError as exc:
        raise PolicyFetchError(f"cannot reach {url}: {exc}") from exc
    if response.status_code != 200:
        raise PolicyFetchError(f"{url} answered {response.status_code}: {_error_message(response)}")
    try:
        return response.json()
    except ValueError as exc:
        raise PolicyFetchError(f"{url} did not answer JSON") from exc


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or response.reason_phrase


def _str(body: dict[str, Any], field: str) -> str | None:
    value = body.get(field)
    return value if isinstance(value, str) else None


def _int(body: dict[str, Any], field: str) -> int | None:
    value = body.get(field)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _rate(body: dict[str, Any]) -> str:
    value = body.get("acceptance_rate")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"acceptance {value:.2f}"
    return "acceptance not measured"


def _pairing(body: dict[str, Any]) -> str | None:
    target, drafter, hardware = _str(body, "target"), _str(body, "drafter"), _str(body, "hardware")
    block = _int(body, "block_size")
    if target is None:
        return None
    text = f"pairing: {target}"
    if drafter:
        text += f" + {drafter}"
    if hardware:
        text += f" on {hardware}"
    if block is not None:
        text += f", K={block}"
    return text


def _headline(body: dict[str, Any]) -> list[str]:
    state = body.get("state")
    if state == "profiling":
        done, required = _int(body, "samples"), _int(body, "samples_required")
        if done is None or required is None:
            return [NO_VERDICT]
        return [f"measuring: {done} of {required} single-request generations done ({_rate(body)} so far)"]
    if state == "settled":
        verdict = body.get("verdict")
        if verdict not in ("enable", "decline"):
            return [NO_VERDICT]
        what = "MTP enabled" if verdict == "enable" else "MTP declined"
        samples = _int(body, "samples")
        line = f"{what}: measured on this machine ({_rate(body)}"
        lines = [line + (f" over {samples} samples)" if samples is not None else ")")]
        limit = _int(body, "depth_limit")
        if verdict == "enable" and limit is not None:
            lines.append(f"single requests from {limit} tokens of context start classic (the burst is estimated "
                         "to stop paying there; the rule of K measures it again)")
        return lines
    if state == "forced":
        enabled = body.get("mtp_enabled")
        if not isinstance(enabled, bool):
            return [NO_VERDICT]
        return [f"MTP pinned {'on' if enabled else 'off'} by the operator "
                "(MLXCEL_ENABLE_MTP_B1); nothing measured"]
    if state == "exactness_declined":
        lines = ["MTP configured but vetoed; running classic decode"]
        detail = _str(body, "decline_detail")
        return lines + ([f"reason: {detail}"] if detail else [])
    if state == "unavailable":
        reason = body.get("reason")
        if reason == "worker_not_ready":
            return ["MTP policy not known yet: the model is still loading"]
        if reason == "not_loaded":
            return ["MTP policy not known: the model is not loaded (it loads when a request names it)"]
        if reason == "no_mtp_dispatch":
            return ["MTP not available: this server has no MTP drafter"]
        if reason == "sharded":
            return ["MTP not available: the model is sharded across processes (--distributed); classic decode"]
        if reason == "adaptive_disabled":
            enabled = body.get("mtp_enabled")
            state_text = {True: "on", False: "off"}.get(enabled) if isinstance(enabled, bool) else None
            return ["adaptive MTP policy disabled (MLXCEL_MTP_ADAPTIVE); nothing measured"
                    + (f"; MTP is {state_text} by pin or static default" if state_text else "")]
    return [NO_VERDICT]


def _batch(body: dict[str, Any]) -> list[str]:
    """Lines on what the rule of K runs: for a request alone (width 1, once the verdict lets the burst run)
    and inside the continuous batch, if the body says anything of them."""
    batch = body.get("batch")
    if not isinstance(batch, dict) or not isinstance(batch.get("speculates"), bool):
        return []
    lone_off = body.get("state") == "unavailable" or body.get("mtp_enabled") is False
    if not batch["speculates"] and lone_off:
        return []  # the headline already says MTP does not run here
    alone: list[str] = []
    together: list[str] = []
    for cell in batch.get("cells") or ():
        if not isinstance(cell, dict):
            continue
        width, low, high, k = (cell.get(f) for f in ("width", "min_depth", "max_depth", "drafts"))
        if not all(isinstance(v, int) for v in (width, low, high, k)):
            continue
        speedup = cell.get("estimated_speedup")
        gain = f", {speedup:.2f}x" if isinstance(speedup, (int, float)) and not isinstance(speedup, bool) else ""
        what = f"{low}-{high} tokens: {f'K={k}{gain}' if k else 'classic'}"
        (alone if width == 1 else together).append(what if width == 1 else f"{width} at once, {what}")
    lines = ["alone, round by round: " + "; ".join(alone)] if alone and not lone_off else []
    if not batch["speculates"]:
        reason = batch.get("reason")
        because = f" ({reason})" if isinstance(reason, str) and reason else ""
        return [*lines, "in the batch: classic decode" + because]
    declined = [f"{w['width']} at once" for w in batch.get("inexact_widths") or ()
                if isinstance(w, dict) and isinstance(w.get("width"), int)]
    inexact = f" (classic, not exact here: {', '.join(declined)})" if declined else ""
    measured = "; ".join(together) if together else "speculation measured per step; nothing measured yet"
    return [*lines, "in the batch: " + measured + inexact]


def render(body: Any) -> str | None:
    """A few lines for a person, or None when the body is not readable at all."""
    if not isinstance(body, dict) or _int(body, "schema_version") != SUPPORTED_SCHEMA_VERSION:
        return None
    lines = _headline(body)
    pairing = _pairing(body)
    if pairing and lines != [NO_VERDICT]:
        lines.append(pairing)
    if lines != [NO_VERDICT]:
        lines.extend(_batch(body))
    return "\n".join(lines)
