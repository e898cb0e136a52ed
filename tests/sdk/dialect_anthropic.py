"""The Anthropic Python SDK against the sidecar's /v1/messages (run by tests/sdk_dialects.rs).

Mode `ok`: create, stream, count_tokens. Mode `error`: one create that the sidecar refuses.
Prints one JSON object with what the SDK saw.
"""

import json
import os
import sys

import anthropic

MSGS = [{"role": "user", "content": "Say hello"}]


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    c = anthropic.Anthropic(
        base_url=os.environ["TG_ROOT"], api_key="sk-ant-dummy", max_retries=0, timeout=20.0
    )
    out = {"sdk_version": anthropic.__version__}
    if mode == "error":
        try:
            c.messages.create(model="chat", max_tokens=64, messages=MSGS)
            out["raised"] = None
        except anthropic.APIStatusError as e:
            out["raised"] = type(e).__name__
            out["status"] = e.status_code
            out["body"] = e.body
            out["retry_after"] = e.response.headers.get("retry-after")
        print(json.dumps(out))
        return
    m = c.messages.create(
        model="chat",
        max_tokens=64,
        system="Be brief.",
        messages=MSGS,
        stop_sequences=["END"],
    )
    out["create"] = {
        "type": type(m).__name__,
        "text": m.content[0].text,
        "stop_reason": m.stop_reason,
        "input": m.usage.input_tokens,
        "output": m.usage.output_tokens,
    }
    with c.messages.stream(model="chat", max_tokens=64, messages=MSGS) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    out["stream"] = {
        "text": text,
        "stop_reason": final.stop_reason,
        "input": final.usage.input_tokens,
        "output": final.usage.output_tokens,
    }
    if mode == "ok":
        out["count"] = c.messages.count_tokens(model="chat", messages=MSGS).input_tokens
    print(json.dumps(out))


main()
