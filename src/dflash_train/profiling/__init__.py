"""Where the time goes: spans, windows, verdicts, reports (every layer may call it; it imports none of them)."""
