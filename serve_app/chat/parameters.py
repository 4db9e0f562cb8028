"""The served model's sampling-parameter policy: what temperature and top_p a request
samples at, or the 400 that names the field.

`k3` is Kimi K3's contract (Moonshot's hosted API fixes these; the Kimi Vendor Verifier's
`tests/params` checks them, in both thinking modes): temperature in [0, 1], defaulting to 1.0
with thinking and 0.6 without; top_p 0.95 (unset, or OpenAI SDKs' 1.0, is taken as 0.95).
presence/frequency penalties other than 0 and n other than 1 are refused for every model
(protocol/openai.py). `open` lets through any value OpenAI allows.
"""

from __future__ import annotations

from serve_app.protocol.openai import OpenAIError, OpenAIRequest, quote

K3_TOP_P = 0.95
K3_TEMPERATURE = {True: 1.0, False: 0.6}


def sampling_values(policy: str, body: OpenAIRequest, thinking: bool) -> tuple[float, float]:
    """(temperature, top_p) for this request under the policy."""
    if policy == "open":
        return body.temperature, body.top_p
    sent = body.model_fields_set
    temperature = body.temperature if "temperature" in sent else K3_TEMPERATURE[thinking]
    if not 0.0 <= temperature <= 1.0:
        raise OpenAIError(400, f"temperature={quote(temperature)} is outside [0, 1], the range "
                          "this model samples at", param="temperature")
    top_p = body.top_p if "top_p" in sent else K3_TOP_P
    if top_p not in (K3_TOP_P, 1.0):
        raise OpenAIError(400, f"top_p={quote(top_p)} is not supported: this model samples at "
                          f"top_p {K3_TOP_P}", param="top_p")
    return temperature, K3_TOP_P
