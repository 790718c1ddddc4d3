"""A small synchronous client for the parts of vLLM's OpenAI server the node agent and heartbeat use."""

from __future__ import annotations

import httpx


class VllmError(Exception):
    """vLLM refused or failed a call. `transient` errors (network, 5xx from a busy engine) are worth retrying."""

    def __init__(self, message: str, *, status: int | None = None, transient: bool = False):
        super().__init__(message)
        self.message = message
        self.status = status
        self.transient = transient


def _error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:500]


class VllmClient:
    def __init__(self, base_url: str, *, timeout: float = 30.0):
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> VllmClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            return self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise VllmError(f"{method} {path}: {type(exc).__name__}: {exc}", transient=True) from exc

    def health(self) -> bool:
        try:
            return self.http.get("/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def models(self) -> list[str]:
        """Names vLLM serves now: the base model and every loaded LoRA."""
        return [entry["id"] for entry in self.model_entries()]

    def model_entries(self) -> list[dict]:
        """vLLM's /v1/models entries: `id`, and `max_model_len` (the context window) among others."""
        response = self._call("GET", "/v1/models", timeout=5.0)
        if response.status_code != 200:
            raise VllmError(f"GET /v1/models: {response.status_code}", status=response.status_code, transient=True)
        return [entry for entry in response.json().get("data", []) if isinstance(entry, dict) and "id" in entry]

    def version(self) -> str:
        try:
            response = self.http.get("/version", timeout=2.0)
            return response.json().get("version", "") if response.status_code == 200 else ""
        except (httpx.HTTPError, ValueError):
            return ""

    def load_lora(self, name: str, path: str, **extra) -> None:
        """Load the adapter at the local `path` under `name`. Loading a name that is already loaded is a no-op."""
        response = self._call("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **extra})
        if response.status_code == 200:
            return
        message = _error_message(response)
        if response.status_code == 400 and "already been loaded" in message:
            return
        raise VllmError(
            f"load {name}: {message}", status=response.status_code, transient=response.status_code in (502, 503, 504)
        )

    def busy_loras(self) -> set[str]:
        """The LoRA names the engine runs or queues requests of now, from its Prometheus metrics: the newest series
        of `vllm:lora_requests_info` (its value is when it was set). An engine idle for a second or more (no
        request running or waiting) runs none, whatever the last series said."""
        response = self._call("GET", "/metrics", timeout=5.0)
        if response.status_code != 200:
            raise VllmError(f"GET /metrics: {response.status_code}", status=response.status_code, transient=True)
        return busy_loras_of(response.text)

    def requests_in_flight(self) -> int:
        """Requests the engine runs or queues now, of every model (vllm:num_requests_running and _waiting)."""
        response = self._call("GET", "/metrics", timeout=2.0)
        if response.status_code != 200:
            raise VllmError(f"GET /metrics: {response.status_code}", status=response.status_code, transient=True)
        return requests_in_flight_of(response.text)

    def unload_lora(self, name: str) -> None:
        """Unload `name`. An unknown name is fine (already gone)."""
        response = self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
        if response.status_code in (200, 404):
            return
        if response.status_code == 400 and "not" in _error_message(response).lower():
            return
        raise VllmError(
            f"unload {name}: {_error_message(response)}",
            status=response.status_code,
            transient=response.status_code >= 500,
        )

    def complete(self, model: str, prompt: str, *, max_tokens: int = 1) -> dict:
        """A real completion against `model` (the warm-up probe of phase 2): vLLM's answer, `usage` included."""
        response = self._call(
            "POST",
            "/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        )
        if response.status_code != 200:
            raise VllmError(
                f"warm-up of {model}: {_error_message(response)}",
                status=response.status_code,
                transient=response.status_code >= 500,
            )
        return response.json()

    def generate(
        self,
        model: str,
        *,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        max_tokens: int,
        timeout: float,
        priority: int | None = None,
    ) -> tuple[str, dict]:
        """A greedy (temperature 0) completion of `prompt`, or chat completion of `messages`, for an evaluation
        case: (the answer's text, vLLM's `usage`). `priority` only for an engine that schedules by it (higher:
        later). Errors as VllmError (5xx and the network: transient)."""
        body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0}
        if priority is not None:
            body["priority"] = priority
        path = "/v1/completions" if messages is None else "/v1/chat/completions"
        body |= {"prompt": prompt} if messages is None else {"messages": messages}
        response = self._call("POST", path, json=body, timeout=timeout)
        if response.status_code != 200:
            raise VllmError(
                f"{path} for {model}: {_error_message(response)}",
                status=response.status_code,
                transient=response.status_code >= 500,
            )
        try:
            data = response.json()
            choice = data["choices"][0]
            text = choice["text"] if messages is None else choice["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise VllmError(f"{path} for {model}: an answer without choices ({exc})") from exc
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        return str(text or ""), usage


def context_window(entries: list[dict]) -> int | None:
    """The engine's max_model_len from its /v1/models entries (the base model's; LoRAs report the same)."""
    lengths = [e.get("max_model_len") for e in entries]
    found = [n for n in lengths if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    return min(found) if found else None


def requests_in_flight_of(text: str) -> int:
    """`VllmClient.requests_in_flight` from the text of vLLM's /metrics: a scan of two gauges' lines (the whole
    exposition, histograms and all, is not parsed for them: the evaluation runner asks before every case)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            try:
                total += float(line.rsplit(" ", 1)[-1])
            except ValueError:
                continue
    return int(total)


def busy_loras_of(text: str) -> set[str]:
    """`VllmClient.busy_loras` from the text of vLLM's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    newest: tuple[float, set[str]] | None = None
    requests = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                requests += sample.value
            elif sample.name == "vllm:lora_requests_info":
                names = {
                    n
                    for label in ("running_lora_adapters", "waiting_lora_adapters")
                    for n in sample.labels.get(label, "").split(",")
                    if n
                }
                if newest is None or sample.value > newest[0]:
                    newest = (sample.value, names)
    if requests == 0 or newest is None:
        return set()
    return newest[1]
