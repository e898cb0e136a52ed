"""The OpenAI SDK's responses.create against the sidecar's /v1/responses (tests/sdk_dialects.rs).

Mode `ok`: buffered and streamed. Mode `error`: one create the sidecar refuses. Prints one
JSON object with what the SDK saw.
"""

import json
import os
import sys

import openai


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    c = openai.OpenAI(
        base_url=os.environ["TG_ROOT"] + "/v1", api_key="sk-dummy", max_retries=0, timeout=20.0
    )
    out = {"sdk_version": openai.__version__}
    kw = dict(model="chat", input="hi", instructions="Be brief.", max_output_tokens=40)
    if mode == "error":
        try:
            c.responses.create(**kw)
            out["raised"] = None
        except openai.APIStatusError as e:
            out["raised"] = type(e).__name__
            out["status"] = e.status_code
            out["body"] = e.body
        print(json.dumps(out))
        return
    r = c.responses.create(**kw)
    out["create"] = {
        "type": type(r).__name__,
        "text": r.output_text,
        "status": r.status,
        "input": r.usage.input_tokens,
        "output": r.usage.output_tokens,
    }
    types, text, final = [], "", None
    for ev in c.responses.create(stream=True, **kw):
        types.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type == "response.completed":
            final = ev.response
    out["stream"] = {
        "types": types,
        "text": text,
        "final_text": final.output_text if final else None,
        "input": final.usage.input_tokens if final else None,
        "output": final.usage.output_tokens if final else None,
    }
    print(json.dumps(out))


main()
