"""What an inference callable is handed (``pytriton.proxy``)."""
