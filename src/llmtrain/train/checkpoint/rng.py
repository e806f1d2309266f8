"""RNG states of one process as JSON: python, numpy, torch CPU and (on CUDA) the accelerator's generator.

Each rank writes its own ``rng_rank{r}.json`` into a checkpoint (see ``layout.rng_file``), so a resumed run
draws exactly the numbers the uninterrupted one would have (dropout masks, data shuffles, sampling). Tensor
states are raw bytes in base64; the stability guard also uses these functions to rewind a rollback.
"""

from __future__ import annotations

import base64
import random

import numpy as np
import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state(device_type: str) -> dict:
    """RNG states of this process as JSON-safe values."""
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()  # the legacy tuple: the global RandomState is always MT19937
    assert isinstance(np_state, tuple)
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    state = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": _b64(torch.get_rng_state()),
    }
    if device_type == "cuda" and torch.cuda.is_available():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def set_rng_state(state: dict, device_type: str) -> None:
    v, s, g = state["python"]
    random.setstate((v, tuple(s), g))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and device_type == "cuda":
        torch.cuda.set_rng_state(_unb64(state["cuda"]))
