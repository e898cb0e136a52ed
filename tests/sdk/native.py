"""The default policy's chain over native backends: one buffered completion, one stream
without usage and one with stream_options.include_usage, as the SDK parses them."""

from _sdk import client, run, tollgate_headers

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hello"}]


def stream(c, include_usage):
    kw = {"stream_options": {"include_usage": True}} if include_usage else {}
    s = c.chat.completions.with_raw_response.create(
        model="chat", messages=MESSAGES, max_tokens=50, stream=True, **kw
    )
    headers = tollgate_headers(s.headers)
    chunks = [ch.model_dump(mode="json", exclude_unset=True) for ch in s.parse()]
    content = "".join(
        (ch_choice.get("delta") or {}).get("content") or ""
        for ch in chunks
        for ch_choice in ch.get("choices", [])
    )
    finish = [
        ch_choice.get("finish_reason")
        for ch in chunks
        for ch_choice in ch.get("choices", [])
        if ch_choice.get("finish_reason")
    ]
    return {
        "content": content,
        "finish": finish,
        "objects": sorted({ch["object"] for ch in chunks}),
        "usage_chunks": [ch["usage"] for ch in chunks if ch.get("usage") is not None],
        "backend": headers.get("x-tollgate-backend"),
    }


def main():
    c = client()
    raw = c.chat.completions.with_raw_response.create(model="chat", messages=MESSAGES, max_tokens=50)
    r = raw.parse()
    return {
        "chat": {
            "type": type(r).__name__,
            "content": r.choices[0].message.content,
            "model": r.model,
            "finish_reason": r.choices[0].finish_reason,
            "usage": {
                "prompt_tokens": r.usage.prompt_tokens,
                "completion_tokens": r.usage.completion_tokens,
                "total_tokens": r.usage.total_tokens,
            },
            "backend": tollgate_headers(raw.headers).get("x-tollgate-backend"),
        },
        "stream": stream(c, False),
        "stream_usage": stream(c, True),
    }


run(main)
