"""Shared helpers of the OpenAI Python SDK test scripts (run by tests/sdk.rs).

Each script prints exactly one JSON object on stdout describing what the SDK saw, and exits
non-zero only on an exception it did not expect (the traceback goes to stderr). The Rust test
decides what is right; the scripts only observe.
"""

import json
import os
import sys
import traceback

import openai


def client(base_url=None, **kw):
    """An SDK client: base URL from OPENAI_BASE_URL unless given, no retries, short timeout."""
    kw.setdefault("max_retries", 0)
    kw.setdefault("timeout", 20.0)
    return openai.OpenAI(
        base_url=base_url or os.environ["OPENAI_BASE_URL"],
        api_key=os.environ.get("OPENAI_API_KEY", "sk-dummy"),
        **kw,
    )


def tollgate_headers(headers):
    """The governance headers of a response (x-tollgate-*, retry-after, x-ratelimit-*)."""
    out = {}
    for k, v in headers.items():
        k = k.lower()
        if k.startswith("x-tollgate-") or k.startswith("x-ratelimit-") or k == "retry-after":
            out[k] = v
    return out


def status_error(e):
    """What an openai.APIStatusError carries: class, status, e.body, the raw JSON body."""
    try:
        raw = e.response.json()
    except Exception:  # not JSON
        raw = e.response.text
    return {
        "class": type(e).__name__,
        "status": e.status_code,
        "body": e.body,
        "response_json": raw,
        "headers": tollgate_headers(e.response.headers),
        "message": str(e),
    }


def run(main):
    """Run main() -> dict, print it as one JSON line; exit 1 with a traceback on an exception."""
    try:
        result = main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    result["sdk_version"] = openai.__version__
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
