#!/usr/bin/env python3
"""A minimal dbtrigger webhook receiver, standard library only.

It does the three things every receiver must do:
  1. verify the Standard Webhooks signature (and refuse stale timestamps);
  2. fence: refuse a delivery whose fencing_token is lower than one already accepted;
  3. de-duplicate on event_id: delivery is at least once, so the same row may come twice.

Run: python3 receiver.py --port 8080 --secret whsec_...
It prints one line per event it applies (and per duplicate it skips); GET /stats shows what it kept.
Replace `apply` with your own idempotent side effect (an upsert, a message, ...).
"""

import argparse
import base64
import hashlib
import hmac
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOLERANCE_SECONDS = 300


class Store:
    """What the receiver remembers. Use a table with a unique key on event_id in real life."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seen_event_ids = set()
        self.highest_token = {}
        self.applied = []
        self.duplicates = 0


def signing_key(secret):
    if secret.startswith("whsec_"):
        return base64.b64decode(secret[len("whsec_"):])
    return secret.encode()


def signature_is_valid(key, headers, body):
    webhook_id = headers.get("webhook-id", "")
    timestamp = headers.get("webhook-timestamp", "")
    if not timestamp.isdigit() or abs(time.time() - int(timestamp)) > TOLERANCE_SECONDS:
        return False
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    offered = [part.split(",", 1)[1] for part in headers.get("webhook-signature", "").split() if part.startswith("v1,")]
    return any(hmac.compare_digest(expected, candidate) for candidate in offered)


def apply(store, event):
    store.applied.append(event["pk"])


def describe(poller, event):
    """One line about an event, for a person watching the receiver: poller, op, key, event id."""
    late = " late" if event.get("late") else ""
    pk = json.dumps(event.get("pk"), sort_keys=True)
    return f"{poller} {event.get('op', '?')}{late} pk={pk} event_id={event['event_id']}"


def make_handler(key, store):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if key is not None and not signature_is_valid(key, self.headers, body):
                return self.answer(401, {"error": "bad signature"})
            envelope = json.loads(body)
            poller, token = envelope["poller"], envelope["fencing_token"]
            with store.lock:
                if token < store.highest_token.get(poller, 0):
                    # A stale instance: a newer one has taken over. dbtrigger holds at a 409 and
                    # never quarantines a row for it.
                    return self.answer(409, {"error": "stale fencing token"})
                store.highest_token[poller] = token
                for event in envelope["events"]:
                    if event["event_id"] in store.seen_event_ids:
                        store.duplicates += 1
                        print(f"duplicate skipped: {describe(poller, event)}", flush=True)
                        continue
                    apply(store, event)
                    store.seen_event_ids.add(event["event_id"])
                    print(f"applied: {describe(poller, event)}", flush=True)
            self.answer(200, {"ok": True})

        def do_GET(self):
            with store.lock:
                self.answer(200, {"applied": store.applied, "duplicates": store.duplicates})

        def answer(self, status, payload):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *arguments):
            pass

    return Handler


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--secret", default=None)
    arguments = parser.parse_args()
    key = signing_key(arguments.secret) if arguments.secret else None
    server = ThreadingHTTPServer(("127.0.0.1", arguments.port), make_handler(key, Store()))
    print(f"listening on 127.0.0.1:{arguments.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
