"""The ollama Python client against the sidecar's /api paths (run by tests/sdk_dialects.rs).

Mode `ok`: chat, chat streamed, generate, embed, list. Mode `error`: one chat the sidecar
refuses. Prints one JSON object with what the client saw.
"""

import importlib.metadata
import json
import os
import sys

import ollama

MSGS = [{"role": "user", "content": "hi"}]


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    c = ollama.Client(host=os.environ["TG_ROOT"], timeout=20)
    out = {"sdk_version": importlib.metadata.version("ollama")}
    if mode == "error":
        try:
            c.chat(model="chat", messages=MSGS)
            out["raised"] = None
        except ollama.ResponseError as e:
            out["raised"] = type(e).__name__
            out["status"] = e.status_code
            out["error"] = e.error
        print(json.dumps(out))
        return
    r = c.chat(model="chat", messages=MSGS)
    out["chat"] = {
        "text": r.message.content,
        "done": r.done,
        "prompt_eval_count": r.prompt_eval_count,
        "eval_count": r.eval_count,
    }
    parts = list(c.chat(model="chat", messages=MSGS, stream=True))
    out["stream"] = {
        "text": "".join(p.message.content or "" for p in parts),
        "done": parts[-1].done,
        "prompt_eval_count": parts[-1].prompt_eval_count,
        "eval_count": parts[-1].eval_count,
    }
    if mode == "ok":
        out["generate"] = c.generate(model="chat", prompt="hi").response
        out["embed_dims"] = len(c.embed(model="embed", input="vector me").embeddings[0])
        out["models"] = [m.model for m in c.list().models]
    print(json.dumps(out))


main()
