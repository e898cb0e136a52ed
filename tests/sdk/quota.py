"""A quota stop: consumer `alice` (used up) gets PermissionDeniedError; `bob` is served."""

import openai

from _sdk import client, run, status_error

MESSAGES = [{"role": "user", "content": "hello"}]


def main():
    out = {}
    alice = client(default_headers={"x-tollgate-consumer": "alice"})
    try:
        r = alice.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=20)
        out["alice"] = {"raised": None, "content": r.choices[0].message.content}
    except openai.APIStatusError as e:
        out["alice"] = {"raised": type(e).__name__, **status_error(e)}
        out["alice"]["is_permission_denied"] = isinstance(e, openai.PermissionDeniedError)
    bob = client(default_headers={"x-tollgate-consumer": "bob"})
    try:
        r = bob.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=20)
        out["bob"] = {"raised": None, "content": r.choices[0].message.content}
    except openai.APIStatusError as e:
        out["bob"] = {"raised": type(e).__name__, **status_error(e)}
    return out


run(main)
