"""The google-genai SDK against the sidecar's Gemini paths (run by tests/sdk_dialects.rs).

Mode `ok`: generate_content, generate_content_stream, count_tokens. Mode `error`: one call the
sidecar refuses. Prints one JSON object with what the SDK saw.
"""

import json
import os
import sys

from google import genai
from google.genai import errors, types


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    opts = types.HttpOptions(
        base_url=os.environ["TG_ROOT"],
        api_version="v1beta",
        timeout=20000,
        retry_options=types.HttpRetryOptions(attempts=1),
    )
    c = genai.Client(api_key="AIza-dummy", http_options=opts)
    cfg = types.GenerateContentConfig(max_output_tokens=32, system_instruction="Be brief.")
    out = {"sdk_version": genai.__version__}
    if mode == "error":
        try:
            c.models.generate_content(model="chat", contents="Say hello", config=cfg)
            out["raised"] = None
        except errors.APIError as e:
            out["raised"] = type(e).__name__
            out["code"] = e.code
            out["status"] = e.status
            out["message"] = e.message
            out["details"] = e.details
        print(json.dumps(out, default=str))
        return
    r = c.models.generate_content(model="chat", contents="Say hello", config=cfg)
    out["generate"] = {
        "text": r.text,
        "finish": str(r.candidates[0].finish_reason),
        "prompt": r.usage_metadata.prompt_token_count,
        "candidates": r.usage_metadata.candidates_token_count,
    }
    text, last = "", None
    for ch in c.models.generate_content_stream(model="chat", contents="Say hello", config=cfg):
        text += ch.text or ""
        if ch.usage_metadata is not None:
            last = ch.usage_metadata
    out["stream"] = {
        "text": text,
        "prompt": last.prompt_token_count if last else None,
        "candidates": last.candidates_token_count if last else None,
    }
    if mode == "ok":
        out["count"] = c.models.count_tokens(model="chat", contents="Say hello").total_tokens
    print(json.dumps(out, default=str))


main()
