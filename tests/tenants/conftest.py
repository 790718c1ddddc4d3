from tests.tenants.smtp import smtp_server  # noqa: F401  (a real SMTP server: tests/tenants/smtp.py)
