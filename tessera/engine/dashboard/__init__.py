"""The live view of the scheduler (`GET /dashboard` on `tessera serve`, and
`tessera simulate --dashboard-file`): queues, the KV block map, each step's batch, rolling rates
and the requests running now.

    engine thread:  LLMEngine.step() ─▶ DashboardRecorder.record_step (only while a page is open)
                    on request, between steps ─▶ DashboardRecorder.snapshot() ─▶ a plain dict
    event loop:     DashboardHub (entrypoints) adds RollingRates ─▶ one SSE event per sample
    simulator:      the same recorder and rates on the virtual clock ─▶ frames in one HTML file

The JSON of one sample is documented in docs/dashboard.md; `page.py` renders the page around it.
"""
