"""A chat completion through the sidecar: content, usage and model round-trip."""

from _sdk import client, run, tollgate_headers


def main():
    c = client()
    raw = c.chat.completions.with_raw_response.create(
        model="chat",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hello"}],
        max_tokens=50,
    )
    r = raw.parse()
    return {
        "type": type(r).__name__,
        "object": r.object,
        "id": r.id,
        "model": r.model,
        "content": r.choices[0].message.content,
        "role": r.choices[0].message.role,
        "finish_reason": r.choices[0].finish_reason,
        "usage": None if r.usage is None else {
            "prompt_tokens": r.usage.prompt_tokens,
            "completion_tokens": r.usage.completion_tokens,
            "total_tokens": r.usage.total_tokens,
        },
        "status": raw.status_code,
        "headers": tollgate_headers(raw.headers),
    }


run(main)
