"""What a worker process plugs into Celery and kombu: the screened transports, the consumer that
dead-letters undecodable messages, the signal handlers and the remote-control guard."""
