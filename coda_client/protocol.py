"""Protocol facts the client and the server share: the client-id metadata key and the rule its value follows."""
from __future__ import annotations

import re

# Who is calling (a worker or trainer name), sent with every call when the client is given one; the server
# shows it in its per-RPC log line, in the in-flight records and in per-client metrics, and may rate-limit
# by it. Letters, digits and -_.:@/ only, so it is safe in a log line and a Prometheus label.
CLIENT_ID_METADATA_KEY = "x-coda-client-id"
MAX_CLIENT_ID_LENGTH = 128
CLIENT_ID_PATTERN = re.compile(r"[A-Za-z0-9_.:@/-]{1,%d}" % MAX_CLIENT_ID_LENGTH)
CLIENT_ID_RULE = (f"1 to {MAX_CLIENT_ID_LENGTH} characters, each a letter, a digit or one of - _ . : @ / "
                  "(e.g. rollout-worker-17 or trainer@node-3)")
