"""DEFER raises RateLimitError (max_retries=0) carrying Retry-After, for two causes:
consumer `alice` hits a full rate-limit window (the sidecar refuses before any call);
consumer `bob` is not rate limited, but the upstream answers 429 with a Retry-After longer
than the sidecar waits in-request."""

import time

import openai

from _sdk import client, run, status_error

MESSAGES = [{"role": "user", "content": "hello"}]


def attempt(consumer):
    c = client(default_headers={"x-tollgate-consumer": consumer}, max_retries=0)
    t0 = time.monotonic()
    try:
        r = c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=10)
        res = {"raised": None, "content": r.choices[0].message.content}
    except openai.APIStatusError as e:
        res = {"raised": type(e).__name__, **status_error(e)}
        res["is_rate_limit_error"] = isinstance(e, openai.RateLimitError)
        res["retry_after"] = e.response.headers.get("retry-after")
    res["elapsed_s"] = time.monotonic() - t0
    return res


def main():
    return {"rate_limited": attempt("alice"), "upstream_429": attempt("bob")}


run(main)
