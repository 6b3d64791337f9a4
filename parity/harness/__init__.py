"""The harness: capture both sides, store, judge, diagnose, report; the pytest plugin."""
