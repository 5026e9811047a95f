"""The operator's view, served by the web process: the health page and its charts, a hold's
story, the scrape-time gauges of /metrics, and /healthz and /readyz."""
