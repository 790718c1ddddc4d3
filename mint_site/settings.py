"""MinT settings, read from the environment (docs/operations.md, "Configuration").

The defaults are the embedded set-up of `make run`: SQLite and artifacts under
`var/`, Redis at REDIS_URL (the launcher starts a private one when it is unset).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from mint_site.env import (
    check_redis_url,
    env_bool,
    env_choice,
    env_dir,
    env_float,
    env_int,
    env_list,
    env_str,
    parse_database_url,
)
from mint_site.secret import secret_key

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("MINT_VAR_DIR", str(BASE_DIR / "var")))

DEBUG = env_bool("DEBUG", False)
# Unset, the key is generated once into VAR_DIR (mint_site/secret.py); MINT_REQUIRE_SECRET_KEY=1 refuses that.
SECRET_KEY = secret_key(
    configured=env_str("SECRET_KEY", ""), var_dir=VAR_DIR, require=env_bool("MINT_REQUIRE_SECRET_KEY", False)
)

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", ["http://127.0.0.1:8000", "http://localhost:8000"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "axes",  # login throttling (settings at the end of this file)
    "tenants",
    "adapters",
    "serving",
    "webhooks",
    "frontend",
]

MIDDLEWARE = [
    "mint_site.metrics.RequestMetricsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "mint_site.static.StaticFilesMiddleware",  # WhiteNoise for /static/ only; keeps the rest async
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # DEBUG's pages (URL patterns, tracebacks) for staff only; plain errors for everyone else.
    "mint_site.debug_pages.StaffOnlyDebugPagesMiddleware",
    # After sessions and authentication: `Idempotency-Key` on the REST API's POSTs (MINT_IDEMPOTENCY_* below).
    "tenants.idempotency.IdempotencyMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "frontend.middleware.NoStoreMiddleware",  # dashboard pages never come back stale from a cache (Back/Forward)
    # Last, as django-axes asks: turns a login refused for too many failures into the 429 lockout page.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "mint_site.urls"
ASGI_APPLICATION = "mint_site.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": parse_database_url(env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'mint.sqlite3'}"), base_dir=BASE_DIR)
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = check_redis_url("REDIS_URL", env_str("REDIS_URL", "redis://127.0.0.1:6379/0"))

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "mint",
    }
}

# How soon a channel-layer connection whose Redis went silent (no FIN, no RST) is found dead: TCP
# keepalive probes after this many idle seconds, then every 5 s, three times.
CHANNEL_LAYER_KEEPALIVE_IDLE_S = 10
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {
            # No client-side socket timeout. A receive blocks in Redis for up to 5 s (channels_redis's
            # brpop_timeout), and redis-py 8 gives up on a read after 5 s by default: every idle receive
            # failed, dropping dashboard sockets and the gateway's event feed every few seconds. Any
            # timeout also sends each write through asyncio.wait_for, which on Python 3.11 can swallow
            # a cancellation that lands as the write completes: a cancelled receive (a socket closing,
            # a gateway stopping) then went on popping forever. A dead connection is found by keepalive.
            "hosts": [
                {
                    "address": REDIS_URL,
                    "socket_timeout": None,
                    "socket_keepalive": True,
                    "socket_keepalive_options": {
                        socket.TCP_KEEPIDLE: CHANNEL_LAYER_KEEPALIVE_IDLE_S,
                        socket.TCP_KEEPINTVL: 5,
                        socket.TCP_KEEPCNT: 3,
                    },
                }
            ],
            "prefix": "mint:ch",
            # Room for a burst of events (activating many revisions) while a gateway applies them in order.
            "capacity": 1000,
        },
    }
}

# Celery: queue "control" for validation/export/reconcile, "node.<name>" per serving node.
CELERY_BROKER_URL = REDIS_URL
CELERY_TASK_DEFAULT_QUEUE = "control"
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A task that is acked late must finish before Redis hands it to another worker.
_TASK_VISIBILITY_TIMEOUT = env_int("MINT_TASK_VISIBILITY_TIMEOUT", 3600, minimum=1)
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": _TASK_VISIBILITY_TIMEOUT,
    # How often a worker looks for tasks a killed worker left unacknowledged. kombu's default sweep
    # (every 10th call of a 10 s interval) could leave one waiting ~100 s past its timeout.
    "unacked_restore_interval": min(10, _TASK_VISIBILITY_TIMEOUT),
    "unacked_restore_throttle": 1,
}
CELERY_TASK_ALWAYS_EAGER = env_bool("MINT_TASKS_EAGER", False)

AUTHENTICATION_BACKENDS = [
    # First: refuses a locked-out username + address before any password is checked (django-axes).
    "frontend.views.auth.LoginThrottleBackend",
    "django.contrib.auth.backends.ModelBackend",
    # Single sign-on through a tenant's OpenID Connect issuer; answers only the /sso/callback/ request.
    "tenants.sso.SsoBackend",
]
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "frontend:login"
LOGIN_REDIRECT_URL = "frontend:overview"
LOGOUT_REDIRECT_URL = "frontend:login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # WhiteNoise warns on every request when it is missing
WHITENOISE_USE_FINDERS = True  # serve app static files without a collectstatic step locally

# Artifact store: where uploaded adapters and their frozen exports live.
MINT_STORAGE = env_choice("MINT_STORAGE", "filesystem", ("filesystem", "s3"))
MINT_ARTIFACT_ROOT = Path(env_str("MINT_ARTIFACT_ROOT", str(VAR_DIR / "artifacts")))
if MINT_STORAGE == "s3":
    _artifacts = {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            "bucket_name": env_str("MINT_S3_BUCKET", ""),
            "endpoint_url": env_str("MINT_S3_ENDPOINT_URL", "") or None,
            "region_name": env_str("MINT_S3_REGION", "") or None,
            "default_acl": None,
            "file_overwrite": False,
        },
    }
    if not _artifacts["OPTIONS"]["bucket_name"]:
        raise ImproperlyConfigured("MINT_STORAGE=s3 needs MINT_S3_BUCKET.")
else:
    _artifacts = {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(MINT_ARTIFACT_ROOT)},
    }
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "artifacts": _artifacts,
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "tenants.auth.ApiKeyAuthentication",
        "tenants.auth.TenantSessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": [
        "rest_framework.parsers.JSONParser",
        "rest_framework.parsers.MultiPartParser",
        "rest_framework.parsers.FormParser",
    ],
    "EXCEPTION_HANDLER": "mint_site.errors.api_exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "mint_site.pagination.CursorPage",
    "PAGE_SIZE": 50,
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "MinT API",
    "DESCRIPTION": (
        "Control plane for LoRA adapter revisions: register, validate, export, approve, "
        "activate and roll back. Authenticate with `Authorization: Bearer mint_<prefix>_<secret>`."
    ),
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "APPEND_COMPONENTS": {
        "securitySchemes": {"ApiKey": {"type": "http", "scheme": "bearer", "bearerFormat": "mint_<prefix>_<secret>"}}
    },
    "SECURITY": [{"ApiKey": []}],
    # Revisions and nodes both have a "state" field; without a name of its own the revision's enum gets a hash.
    "ENUM_NAME_OVERRIDES": {"RevisionStateEnum": "adapters.models.RevisionState"},
}

# Adapter artifacts: what validation accepts.
# One safetensors header (200,000 tensors with long MoE names need about 30 MB), and all the
# headers of one adapter together: many files each near the first bound are refused, not parsed.
MINT_SAFETENSORS_MAX_HEADER_BYTES = env_int("MINT_SAFETENSORS_MAX_HEADER_BYTES", 32 * 1024 * 1024, minimum=1024)
MINT_SAFETENSORS_MAX_TOTAL_HEADER_BYTES = env_int(
    "MINT_SAFETENSORS_MAX_TOTAL_HEADER_BYTES", 64 * 1024 * 1024, minimum=1024
)
MINT_MAX_TENSORS = env_int("MINT_MAX_TENSORS", 200_000, minimum=1)
MINT_ARCHIVE_MAX_FILES = env_int("MINT_ARCHIVE_MAX_FILES", 100_000, minimum=1)
MINT_ARCHIVE_MAX_BYTES = env_int("MINT_ARCHIVE_MAX_BYTES", 4 * 1024**3, minimum=1)
MINT_ARCHIVE_MAX_RATIO = env_int("MINT_ARCHIVE_MAX_RATIO", 200, minimum=1)
# An archive's own headers, bounded before the standard library reads them whole (adapters/artifacts/archive.py):
# a member's name (GNU long names and PAX paths included), one PAX header and the records in it, a zip's
# central directory.
MINT_ARCHIVE_MAX_NAME_BYTES = env_int("MINT_ARCHIVE_MAX_NAME_BYTES", 4096, minimum=256)
MINT_ARCHIVE_MAX_PAX_HEADER_BYTES = env_int("MINT_ARCHIVE_MAX_PAX_HEADER_BYTES", 64 * 1024, minimum=1024)
MINT_ARCHIVE_MAX_PAX_RECORDS = env_int("MINT_ARCHIVE_MAX_PAX_RECORDS", 256, minimum=16)
MINT_ARCHIVE_MAX_ZIP_DIRECTORY_BYTES = env_int("MINT_ARCHIVE_MAX_ZIP_DIRECTORY_BYTES", 32 * 1024 * 1024, minimum=1024)
MINT_WORK_DIR = env_str("MINT_WORK_DIR", "") or None  # scratch space for validation/export (default: system temp)
# Lineage of training runs (adapters/runs.py): a revision's metrics, and how many of a run's revisions one answer
# of the runs API lists.
MINT_RUN_METRICS_MAX_KEYS = env_int("MINT_RUN_METRICS_MAX_KEYS", 32, minimum=1)
MINT_RUN_METRICS_MAX_BYTES = env_int("MINT_RUN_METRICS_MAX_BYTES", 4096, minimum=64)
MINT_RUN_PAGE = env_int("MINT_RUN_PAGE", 1000, minimum=10)

# ---------------------------------------------------------------- hostile tenants (docs/limits.md)
# Work on tenant files (validation, export) runs in a child process of the worker under these bounds
# (mint_site/sandbox.py): past the soft time limit it is asked to stop, past the hard one it is killed;
# its memory may grow by MINT_TASK_MEMORY_MB over what the worker had mapped.
MINT_TASK_SOFT_TIME_LIMIT_S = env_float("MINT_TASK_SOFT_TIME_LIMIT_S", 600.0, minimum=0.1)
MINT_TASK_TIME_LIMIT_S = max(
    env_float("MINT_TASK_TIME_LIMIT_S", MINT_TASK_SOFT_TIME_LIMIT_S + 30, minimum=0.2), MINT_TASK_SOFT_TIME_LIMIT_S
)
MINT_TASK_MEMORY_MB = env_int("MINT_TASK_MEMORY_MB", 4096, minimum=64)
# Such work that has run this long moves to the lowest CPU and I/O priority: a short validation (most of them)
# never does, a long one (a large adapter, a crafted archive) yields to the short ones of everybody else.
MINT_TASK_DEMOTE_AFTER_S = env_float("MINT_TASK_DEMOTE_AFTER_S", 0.25, minimum=0)
# Deliveries of one stage's task that may start and never come back (a killed worker) before the revision fails.
MINT_TASK_MAX_DELIVERIES = env_int("MINT_TASK_MAX_DELIVERIES", 3, minimum=1)
# Validations and exports handed to the control workers at once, fairly across tenants (adapters/dispatch.py);
# each tenant at most its plan's max_concurrent_tasks. Set it to the control workers' total concurrency.
MINT_CONTROL_CONCURRENCY = env_int("MINT_CONTROL_CONCURRENCY", 2, minimum=1)
# A revision validating or exporting for longer than this is shown as stalled (the API's `stalled_since`); one
# handed to a worker and not back after this (and at least the tasks' hard time limit) is handed over again,
# and fails `<stage>_lost` (retryable) past MINT_TASK_MAX_DELIVERIES lost hand-offs (adapters/dispatch.py).
MINT_STAGE_STALE_AFTER_S = env_int("MINT_STAGE_STALE_AFTER_S", 600, minimum=1)
# A task handed to a queue (validation, export, a rollback's re-export, prewarm, unload) that no worker has begun
# this long after was lost with the broker (a flushed or restarted Redis), once its queue has moved past it: a
# probe sent behind it reached a worker. It is sent again, counted as a delivery of its row (adapters/dispatch.py,
# serving/services/sweep.py). Work a worker began is never sent twice before its hard time limit.
MINT_TASK_PICKUP_S = env_float("MINT_TASK_PICKUP_S", 60.0, minimum=0.1)
# Uploads of failed and rejected revisions are removed this long after they ended (the rows and audit stay).
MINT_UPLOAD_RETENTION_DAYS = env_float("MINT_UPLOAD_RETENTION_DAYS", 7.0, minimum=0)
# Retention (serving/services/retention.py): archives per run of the beat ("retention-sweep"), after an export or
# when a registration finds the quota full, and adapters looked at per beat run.
MINT_RETENTION_BATCH = env_int("MINT_RETENTION_BATCH", 200, minimum=1)
MINT_RETENTION_ADAPTERS_PER_RUN = env_int("MINT_RETENTION_ADAPTERS_PER_RUN", 1000, minimum=1)
MINT_RETENTION_SWEEP_S = env_float("MINT_RETENTION_SWEEP_S", 600.0, minimum=1)
# A revision's exported files: how long a download link lasts (signed, or the S3 store's presigned URL), and the
# largest export whose tensor norms the dashboard's diff computes (larger ones show shapes only).
MINT_DOWNLOAD_LINK_S = env_int("MINT_DOWNLOAD_LINK_S", 600, minimum=10)
MINT_INSPECT_MAX_BYTES = env_int("MINT_INSPECT_MAX_BYTES", 64 * 1024 * 1024, minimum=0)
# The dashboard's playground (serving/services/playground.py): how long a node may take to answer it.
MINT_PLAYGROUND_TIMEOUT_S = env_float("MINT_PLAYGROUND_TIMEOUT_S", 30.0, minimum=1)

# Request bodies, refused by the ASGI layer before Django reads (and spools) them (mint_site/limits.py):
# any route but the upload routes and the gateway. Upload routes take at most MINT_MAX_UPLOAD_BYTES from
# anyone, and no more than the caller's tenant allows once its key or session is resolved.
MINT_MAX_REQUEST_BYTES = env_int("MINT_MAX_REQUEST_BYTES", 4 * 1024 * 1024, minimum=1024)
MINT_MAX_UPLOAD_BYTES = env_int("MINT_MAX_UPLOAD_BYTES", 8 * 1024**3, minimum=1024)
# Requests without an API key or a session cookie (mint_site/limits.py): together at most this many per second
# per web process (health probes and static files aside; past it 429 at once), each with at most this much body.
MINT_ANON_REQUESTS_PER_S = env_int("MINT_ANON_REQUESTS_PER_S", 20, minimum=1)
# Anonymous requests past the throttle held until its window ends before their 429, at most this many at once.
MINT_ANON_HELD = env_int("MINT_ANON_HELD", 512, minimum=0)
MINT_ANON_MAX_REQUEST_BYTES = env_int("MINT_ANON_MAX_REQUEST_BYTES", 64 * 1024, minimum=1024)
# Many-file adapters (one safetensors per tensor) are uploaded as tens of thousands of files: the upload routes
# take up to MINT_UPLOAD_MAX_FILES, every other form MINT_FORM_MAX_FILES (mint_site/uploads.py).
MINT_UPLOAD_MAX_FILES = env_int("MINT_UPLOAD_MAX_FILES", 100_000, minimum=1)
MINT_FORM_MAX_FILES = env_int("MINT_FORM_MAX_FILES", 100, minimum=0)
DATA_UPLOAD_MAX_NUMBER_FILES = max(MINT_UPLOAD_MAX_FILES, MINT_FORM_MAX_FILES)
FILE_UPLOAD_MAX_MEMORY_SIZE = 2 * 1024 * 1024  # larger uploads spill to temporary files, never whole in memory
FILE_UPLOAD_HANDLERS = [
    "mint_site.uploads.FileCountHandler",
    "django.core.files.uploadhandler.MemoryFileUploadHandler",
    "mint_site.uploads.ClosedFileUploadHandler",
]

# Resumable uploads (adapters/uploads.py): one archive sent as numbered parts of MINT_UPLOAD_PART_BYTES (never
# below S3's 5 MiB multipart minimum; every part but the last is exactly this long, and a part's body is read
# with this bound), at most MINT_UPLOAD_MAX_OPEN_SESSIONS open sessions per tenant, each collected with its parts
# MINT_UPLOAD_SESSION_TTL_S after it was opened or last received a part (beat, "upload-sessions-collect").
MINT_UPLOAD_PART_BYTES = env_int("MINT_UPLOAD_PART_BYTES", 8 * 1024 * 1024, minimum=5 * 1024 * 1024)
MINT_UPLOAD_MAX_OPEN_SESSIONS = env_int("MINT_UPLOAD_MAX_OPEN_SESSIONS", 4, minimum=1)
MINT_UPLOAD_SESSION_TTL_S = env_int("MINT_UPLOAD_SESSION_TTL_S", 86400, minimum=60)

# Idempotency-Key on the REST API's POSTs (tenants/idempotency.py): a key and the first answer are kept this long
# per caller (an API key, or a person in a tenant), then purged hourly; keys are at most this many characters
# (and never more than 255); answers larger than this are not kept (a retry gets 409 idempotency_response_not_kept);
# a claim whose request never finished (its process died) is taken over by a retry after MINT_IDEMPOTENCY_LOCK_S.
MINT_IDEMPOTENCY_TTL_S = env_int("MINT_IDEMPOTENCY_TTL_S", 24 * 3600, minimum=60)
MINT_IDEMPOTENCY_KEY_MAX_LENGTH = min(env_int("MINT_IDEMPOTENCY_KEY_MAX_LENGTH", 255, minimum=16), 255)
MINT_IDEMPOTENCY_MAX_RESPONSE_BYTES = env_int("MINT_IDEMPOTENCY_MAX_RESPONSE_BYTES", 64 * 1024, minimum=1024)
MINT_IDEMPOTENCY_LOCK_S = env_int("MINT_IDEMPOTENCY_LOCK_S", 900, minimum=1)
# Live Idempotency-Key rows one tenant may keep (they hold answers, on the database all tenants share).
MINT_IDEMPOTENCY_MAX_KEYS_PER_TENANT = env_int("MINT_IDEMPOTENCY_MAX_KEYS_PER_TENANT", 10_000, minimum=1)

# Failed authentication (bad or unknown API keys, on the REST API and the gateway) per client address:
# past this many in a minute, the address gets 429 with Retry-After before any key is looked up.
MINT_AUTH_FAILURES_PER_MIN = env_int("MINT_AUTH_FAILURES_PER_MIN", 30, minimum=1)

# Serving plane.
MINT_NODE_COLD_LOADS = env_int("MINT_NODE_COLD_LOADS", 1, minimum=1)  # loads in flight per node
# Share of a node's time that prewarms may take: after a prewarm that kept the node busy t s, its
# next one (rollbacks excepted) waits t·(1-duty)/duty, at most MINT_NODE_PREWARM_MAX_GAP_S. 1 = no pacing.
MINT_NODE_PREWARM_DUTY = min(1.0, env_float("MINT_NODE_PREWARM_DUTY", 0.02, minimum=0.01))
MINT_NODE_PREWARM_MAX_GAP_S = env_float("MINT_NODE_PREWARM_MAX_GAP_S", 10.0, minimum=0)
# Loads for requests (on demand) are paced apart from activations: a tenant's take of a node's load time.
MINT_NODE_COLD_DUTY = min(1.0, env_float("MINT_NODE_COLD_DUTY", 0.5, minimum=0.01))
# And, while others use a node, one tenant's loads on demand there start at most this many a minute (0: no bound).
# Each brings onto the engine everyone shares more than its own seconds show: its warm-up, the request it serves
# and its victim's unload (benchmarks/long_tail: a scan at 50 loads a minute raised a neighbour's p95 by a third).
MINT_NODE_COLD_LOADS_PER_MIN = env_int("MINT_NODE_COLD_LOADS_PER_MIN", 30, minimum=0)
# Pacing applies only while another tenant used the node within this many seconds (it protects them); 0: always.
MINT_NODE_PACING_NEIGHBOUR_S = env_int("MINT_NODE_PACING_NEIGHBOUR_S", 60, minimum=0)
# Residency (serving/residency/): each node's on-demand slots as a W-TinyLFU cache with a cap per tenant.
MINT_RESIDENCY_WINDOW = env_float("MINT_RESIDENCY_WINDOW", 0.2, minimum=0.01)  # the window's share of the slots
MINT_RESIDENCY_PROTECTED = env_float("MINT_RESIDENCY_PROTECTED", 0.8, minimum=0)  # protected's share of main
# The share of a node's on-demand slots past which a tenant makes room only from its own or one-off entries.
MINT_RESIDENCY_TENANT_CAP = min(1.0, env_float("MINT_RESIDENCY_TENANT_CAP", 0.5, minimum=0.01))
MINT_RESIDENCY_FREQUENCY_PERIOD_S = env_int("MINT_RESIDENCY_FREQUENCY_PERIOD_S", 300, minimum=1)  # aging period
# A placement loaded within this many seconds and not used since (a request's retry finds what was loaded for it),
# or used within them and asked for more than once lately (a working set larger than the node waits instead of
# thrashing), is not evicted for an on-demand load.
MINT_RESIDENCY_MIN_RESIDENT_S = env_float("MINT_RESIDENCY_MIN_RESIDENT_S", 5.0, minimum=0)
# Time-slicing: an on-demand entry in use that has been loaded this many seconds may leave for a recurring ask that
# found no room, so that a busy working set larger than the node is served in turns (LoRAX's adapter exchange); a
# one-off ask (a scan's) never takes a turn. 0: never (the node's entries in use stay, the rest wait).
MINT_RESIDENCY_QUANTUM_S = env_float("MINT_RESIDENCY_QUANTUM_S", 30.0, minimum=0)
# A client's retry that finds its revision's load due within this many seconds is held for it (0: never).
MINT_RESIDENCY_RETRY_HOLD_S = env_float("MINT_RESIDENCY_RETRY_HOLD_S", 2.0, minimum=0)
MINT_RESIDENCY_FLUSH_S = env_float("MINT_RESIDENCY_FLUSH_S", 1.0, minimum=0)  # request counts, placement uses
MINT_RESIDENCY_NODE_CHOICES = env_int("MINT_RESIDENCY_NODE_CHOICES", 3, minimum=1)  # nodes a load may try
MINT_RESIDENCY_DISK_CHOICES = env_int("MINT_RESIDENCY_DISK_CHOICES", 3, minimum=1)  # best nodes checked for files
# The disk tier: node-local copies of exports kept after unload, least recently used removed past this.
MINT_NODE_DISK_BYTES = env_int("MINT_NODE_DISK_BYTES", 20 * 1024**3, minimum=0)
# An unload waits for the engine's requests of that adapter to end, at most this long (then unloads anyway).
MINT_UNLOAD_DRAIN_S = env_float("MINT_UNLOAD_DRAIN_S", 60.0, minimum=0)
# A revision served on demand from one node with this many requests in flight there gets another placement.
MINT_RESIDENCY_SPREAD_INFLIGHT = env_int("MINT_RESIDENCY_SPREAD_INFLIGHT", 8, minimum=1)
MINT_PREWARM_ATTEMPTS = env_int("MINT_PREWARM_ATTEMPTS", 3, minimum=1)
MINT_PREWARM_TIMEOUT_S = env_int("MINT_PREWARM_TIMEOUT_S", 300, minimum=10)
MINT_ALIAS_READY_REPLICAS = env_int("MINT_ALIAS_READY_REPLICAS", 1, minimum=1)  # ready nodes before a flip
MINT_ROLLBACK_GRACE_S = env_int("MINT_ROLLBACK_GRACE_S", 900, minimum=0)  # previous revision stays loaded
# Canary rollout (serving/services/canary.py): the automatic abort's rule, and how the gateway counts.
MINT_CANARY_ERROR_MARGIN = env_float("MINT_CANARY_ERROR_MARGIN", 0.05, minimum=0)
MINT_CANARY_MIN_REQUESTS = env_int("MINT_CANARY_MIN_REQUESTS", 100, minimum=1)
MINT_CANARY_LATENCY_MARGIN = env_float("MINT_CANARY_LATENCY_MARGIN", 0.0, minimum=0)  # 0: latency rule off
MINT_CANARY_LATENCY_WINDOW_S = env_int("MINT_CANARY_LATENCY_WINDOW_S", 30, minimum=1)
MINT_CANARY_LATENCY_WINDOWS = env_int("MINT_CANARY_LATENCY_WINDOWS", 5, minimum=1)
MINT_CANARY_FLUSH_S = env_float("MINT_CANARY_FLUSH_S", 0.25, minimum=0.01)  # gateway → Redis counters
MINT_CANARY_USER_MAX_CHARS = env_int("MINT_CANARY_USER_MAX_CHARS", 256, minimum=1)  # of `user`, hashed
MINT_CANARY_COUNTER_TTL_S = env_int("MINT_CANARY_COUNTER_TTL_S", 7 * 86400, minimum=60)
MINT_NODE_FILE_GRACE_S = env_int("MINT_NODE_FILE_GRACE_S", 300, minimum=0)  # node files kept after unload
MINT_HEARTBEAT_S = env_int("MINT_HEARTBEAT_S", 5, minimum=1)
# A placement that failed every attempt is not queued again by cold requests before this many seconds
# (an activation or rollback, a person's choice, queues it again at once).
MINT_PLACEMENT_FAILED_BACKOFF_S = env_int("MINT_PLACEMENT_FAILED_BACKOFF_S", 300, minimum=0)
# The evaluation gate (adapters/suites.py, serving/services/evaluation.py): a suite's bytes, one line's bytes, one
# regex's bytes and RE2 memory; one evaluation's whole time (placement included), its default max_tokens per case
# (never above the plan's max_evaluation_tokens), and the answer characters kept per case.
MINT_EVALUATION_MAX_SUITE_BYTES = env_int("MINT_EVALUATION_MAX_SUITE_BYTES", 1024 * 1024, minimum=1024)
MINT_EVALUATION_MAX_LINE_BYTES = env_int("MINT_EVALUATION_MAX_LINE_BYTES", 16 * 1024, minimum=256)
MINT_EVALUATION_MAX_PATTERN_BYTES = env_int("MINT_EVALUATION_MAX_PATTERN_BYTES", 1024, minimum=16)
MINT_EVALUATION_REGEX_MAX_MEM = env_int("MINT_EVALUATION_REGEX_MAX_MEM", 1024 * 1024, minimum=64 * 1024)
MINT_EVALUATION_TIMEOUT_S = env_int("MINT_EVALUATION_TIMEOUT_S", 600, minimum=5)
MINT_EVALUATION_DEFAULT_MAX_TOKENS = env_int("MINT_EVALUATION_DEFAULT_MAX_TOKENS", 32, minimum=1)
MINT_EVALUATION_EXCERPT_CHARS = env_int("MINT_EVALUATION_EXCERPT_CHARS", 300, minimum=16)
# The node agent runs an evaluation's cases this long at a time, then queues the rest behind its other work.
MINT_EVALUATION_SLICE_S = env_float("MINT_EVALUATION_SLICE_S", 5.0, minimum=0.1)
# Before each batch of cases the runner waits, at most this long, for the node to have no one's requests running
# or queued: evaluations fill the gaps of the tenants' inference (0: never waits). serving/services/evaluation.py.
MINT_EVALUATION_YIELD_S = env_float("MINT_EVALUATION_YIELD_S", 1.0, minimum=0)
# An adapter keeps its newest this many suite versions (older ones go, with their evaluations).
MINT_EVALUATION_SUITE_VERSIONS_KEPT = env_int("MINT_EVALUATION_SUITE_VERSIONS_KEPT", 10, minimum=1)
# The gateway (serving/gateway/): how long routes and keys are cached (live events refresh routes
# sooner), how often usage is written, upstream timeouts.
MINT_GATEWAY_CACHE_S = env_float("MINT_GATEWAY_CACHE_S", 1.0, minimum=0)
MINT_GATEWAY_FOLLOWED_CACHE_S = env_float("MINT_GATEWAY_FOLLOWED_CACHE_S", 30.0, minimum=0)
MINT_GATEWAY_FOLLOWED_STALE_S = env_float("MINT_GATEWAY_FOLLOWED_STALE_S", 600.0, minimum=0)
MINT_GATEWAY_KEY_CACHE_S = env_float("MINT_GATEWAY_KEY_CACHE_S", 5.0, minimum=0)
MINT_GATEWAY_USAGE_FLUSH_S = env_float("MINT_GATEWAY_USAGE_FLUSH_S", 10.0, minimum=0)
MINT_GATEWAY_NOT_READY_RETRY_S = env_int("MINT_GATEWAY_NOT_READY_RETRY_S", 5, minimum=1)
MINT_GATEWAY_CONNECT_TIMEOUT_S = env_float("MINT_GATEWAY_CONNECT_TIMEOUT_S", 3.0, minimum=0.1)
MINT_GATEWAY_READ_TIMEOUT_S = env_float("MINT_GATEWAY_READ_TIMEOUT_S", 300.0, minimum=1)
MINT_GATEWAY_MAX_CONNECTIONS = env_int("MINT_GATEWAY_MAX_CONNECTIONS", 1000, minimum=1)
MINT_GATEWAY_FOLLOW_EVENTS = env_bool("MINT_GATEWAY_FOLLOW_EVENTS", True)
# Gateway fairness (serving/gateway/): streams whose client stopped reading, and a stream's whole life.
MINT_GATEWAY_STREAM_IDLE_S = env_float("MINT_GATEWAY_STREAM_IDLE_S", 30.0, minimum=0.1)
MINT_GATEWAY_STREAM_MAX_S = env_float("MINT_GATEWAY_STREAM_MAX_S", 900.0, minimum=1)
# A tenant's requests in flight are counted across gateway processes through Redis under leases of this
# long (a dead process's stop counting after one lease); serving/gateway/inflight.py.
MINT_GATEWAY_INFLIGHT_LEASE_S = env_float("MINT_GATEWAY_INFLIGHT_LEASE_S", 10.0, minimum=1)
# Upstream slots per node in each gateway process, shared fairly between tenants (serving/gateway/fairslots.py),
# and how long a request may wait for one before 503 node_busy.
MINT_GATEWAY_NODE_SLOTS = env_int("MINT_GATEWAY_NODE_SLOTS", min(256, MINT_GATEWAY_MAX_CONNECTIONS), minimum=1)
if MINT_GATEWAY_NODE_SLOTS > MINT_GATEWAY_MAX_CONNECTIONS:
    raise ImproperlyConfigured(
        f"MINT_GATEWAY_NODE_SLOTS={MINT_GATEWAY_NODE_SLOTS} is more than MINT_GATEWAY_MAX_CONNECTIONS="
        f"{MINT_GATEWAY_MAX_CONNECTIONS}: a node's slots must fit in its connection pool."
    )
MINT_GATEWAY_NODE_WAIT_S = env_float("MINT_GATEWAY_NODE_WAIT_S", 5.0, minimum=0)
# A node a gateway process failed to reach is tried after the other replicas for this long, and probed at
# once (serving/gateway/nodehealth.py).
MINT_GATEWAY_NODE_SUSPECT_S = env_float("MINT_GATEWAY_NODE_SUSPECT_S", 10.0, minimum=0.1)
CELERY_BEAT_SCHEDULE = {
    "nodes-heartbeat": {"task": "serving.tasks.nodes_heartbeat", "schedule": float(MINT_HEARTBEAT_S)},
    # Dispatching follows every change of the control queue; this only catches a hand-off that was lost.
    "control-dispatch": {"task": "adapters.tasks.control_dispatch", "schedule": 10.0},
    "uploads-collect": {"task": "adapters.tasks.uploads_collect", "schedule": 3600.0},
    "upload-sessions-collect": {"task": "adapters.tasks.upload_sessions_collect", "schedule": 900.0},
    "idempotency-purge": {"task": "tenants.tasks.idempotency_purge", "schedule": 3600.0},
    "usage-purge": {"task": "serving.tasks.usage_purge", "schedule": 3600.0},
    "retention-sweep": {"task": "serving.tasks.retention_sweep", "schedule": MINT_RETENTION_SWEEP_S},
    # Each delivery queues its own attempts; this only catches one whose message was lost (and purges old ones).
    "webhooks-sweep": {"task": "webhooks.tasks.webhooks_sweep", "schedule": 60.0},
}
# Metered usage (serving/gateway/metering.py): per-minute rows are kept this many days, per-hour rows this many;
# per-day rows are kept for good.
MINT_USAGE_MINUTE_RETENTION_DAYS = env_int("MINT_USAGE_MINUTE_RETENTION_DAYS", 7, minimum=1)
MINT_USAGE_HOUR_RETENTION_DAYS = env_int("MINT_USAGE_HOUR_RETENTION_DAYS", 93, minimum=1)

# Webhooks (webhooks/): attempts per delivery, the first retry's delay (doubling, at most an hour), one attempt's
# whole time and the response bytes read, how long deliveries are kept. Receivers on loopback, private,
# link-local and reserved addresses are refused unless MINT_WEBHOOK_ALLOW_PRIVATE (tests, a closed network).
MINT_WEBHOOK_MAX_ATTEMPTS = env_int("MINT_WEBHOOK_MAX_ATTEMPTS", 8, minimum=1)
MINT_WEBHOOK_BACKOFF_S = env_float("MINT_WEBHOOK_BACKOFF_S", 10.0, minimum=0)
MINT_WEBHOOK_TIMEOUT_S = env_float("MINT_WEBHOOK_TIMEOUT_S", 5.0, minimum=0.1)
MINT_WEBHOOK_CONNECT_TIMEOUT_S = env_float("MINT_WEBHOOK_CONNECT_TIMEOUT_S", 2.0, minimum=0.1)  # within the above
# Deliveries run on their own queue (`webhooks`) and worker: `make run` starts it with this many threads.
MINT_WEBHOOK_WORKERS = env_int("MINT_WEBHOOK_WORKERS", 4, minimum=1)
# Attempts one tenant makes at once, over all its endpoints: what its slow receivers can hold of the workers.
MINT_WEBHOOK_TENANT_CONCURRENCY = env_int("MINT_WEBHOOK_TENANT_CONCURRENCY", 1, minimum=1)
# Pending deliveries past which a tenant's pings and redeliveries are refused (429 webhook_backlog_full).
MINT_WEBHOOK_MAX_PENDING = env_int("MINT_WEBHOOK_MAX_PENDING", 1000, minimum=1)
MINT_WEBHOOK_MAX_RESPONSE_BYTES = env_int("MINT_WEBHOOK_MAX_RESPONSE_BYTES", 64 * 1024, minimum=0)
MINT_WEBHOOK_RETENTION_DAYS = env_int("MINT_WEBHOOK_RETENTION_DAYS", 30, minimum=1)
MINT_WEBHOOK_ALLOW_PRIVATE = env_bool("MINT_WEBHOOK_ALLOW_PRIVATE", False)

# API keys: how often last_used_at may be written for one key.
MINT_KEY_TOUCH_INTERVAL_S = env_int("MINT_KEY_TOUCH_INTERVAL_S", 60, minimum=1)
# API keys: the most adapters one key's allow-list may name (tenants/services.py, api_key_create).
MINT_KEY_MAX_ADAPTERS = env_int("MINT_KEY_MAX_ADAPTERS", 100, minimum=1)

# ---------------------------------------------------------------- teams (docs/tenants.md, "Teams")
# Mail: invitations and password resets. `smtp` sends through EMAIL_HOST:EMAIL_PORT (with EMAIL_HOST_USER,
# EMAIL_HOST_PASSWORD, EMAIL_USE_TLS or EMAIL_USE_SSL); `console` prints each message to the log (`make run`).
MINT_EMAIL = env_choice("MINT_EMAIL", "smtp", ("smtp", "console"))
EMAIL_BACKEND = {
    "smtp": "django.core.mail.backends.smtp.EmailBackend",
    "console": "django.core.mail.backends.console.EmailBackend",
}[MINT_EMAIL]
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_USE_SSL = env_bool("EMAIL_USE_SSL", False)
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT", 10, minimum=1)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "MinT <mint@localhost>")
# The site's address in mailed links (https://mint.example.com); empty: the address the request came to.
MINT_SITE_URL = env_str("MINT_SITE_URL", "").rstrip("/")
# Invitations (tenants/members.py): how long a mailed link works; how many a tenant may have pending at once.
MINT_INVITATION_TTL_S = env_int("MINT_INVITATION_TTL_S", 7 * 86400, minimum=60)
MINT_MAX_PENDING_INVITATIONS = env_int("MINT_MAX_PENDING_INVITATIONS", 50, minimum=1)
# Password reset links (Django's): how long one works.
PASSWORD_RESET_TIMEOUT = env_int("MINT_PASSWORD_RESET_TTL_S", 3600, minimum=60)
# Password reset mails per address and per client address a minute (tenants/throttles-style, in Redis).
MINT_PASSWORD_RESETS_PER_MIN = env_int("MINT_PASSWORD_RESETS_PER_MIN", 5, minimum=1)
# Single sign-on (tenants/sso.py): how long to wait for the identity provider's token, key and user endpoints.
MINT_OIDC_TIMEOUT_S = env_int("MINT_OIDC_TIMEOUT_S", 10, minimum=1)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("MINT_LOG_LEVEL", "INFO")},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        "httpx": {"level": "WARNING"},  # one line per proxied request otherwise
    },
}

# ---------------------------------------------------------------- operations (docs/limits.md)
# /metrics names every tenant and adapter: it answers a signed-in staff session, or this bearer token (for the
# Prometheus scraper). Unset, only staff sessions get in.
MINT_METRICS_TOKEN = env_str("MINT_METRICS_TOKEN", "").strip()
if MINT_METRICS_TOKEN and len(MINT_METRICS_TOKEN) < 32:
    raise ImproperlyConfigured("MINT_METRICS_TOKEN is shorter than 32 characters; use a long random string.")
# Several web processes on one host (uvicorn --workers) keep their metric values in files in this directory and
# /metrics sums them: prometheus_client's multiprocess mode, which reads the same variable when it is imported.
# Unset, one process serves and keeps its values in memory. Empty it before the processes start.
PROMETHEUS_MULTIPROC_DIR = env_dir("PROMETHEUS_MULTIPROC_DIR")

# HTTPS. The defaults serve `make run` over plain http on 127.0.0.1; a deployment behind TLS turns these on
# (tests/mint_site/test_deploy_check.py holds the production environment that `check --deploy` passes with).
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = env_bool("MINT_SECURE_COOKIES", False)
SECURE_HSTS_SECONDS = env_int("MINT_HSTS_SECONDS", 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("MINT_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("MINT_HSTS_PRELOAD", False)
SECURE_SSL_REDIRECT = env_bool("MINT_SSL_REDIRECT", False)
# Probes talk plain http to the pod; a redirect would fail them. (Paths here have no leading slash.)
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$"]
# The header a TLS-terminating proxy sets to "https" (e.g. X-Forwarded-Proto). Name one only when that proxy
# overwrites the header on every request: otherwise any client could claim https. (uvicorn already takes the
# scheme from proxies listed in its --forwarded-allow-ips; this is for set-ups where that list is not used.)
_trusted_proxy_header = env_str("MINT_TRUSTED_PROXY_HEADER", "").strip()
if _trusted_proxy_header:
    if not _trusted_proxy_header.replace("-", "").isalnum() or not _trusted_proxy_header.isascii():
        raise ImproperlyConfigured(
            f"MINT_TRUSTED_PROXY_HEADER={_trusted_proxy_header!r} is not a header name such as X-Forwarded-Proto."
        )
    SECURE_PROXY_SSL_HEADER = ("HTTP_" + _trusted_proxy_header.upper().replace("-", "_"), "https")

# Login throttling (django-axes) for the dashboard's /login/ and the admin's: after MINT_LOGIN_FAILURE_LIMIT
# failed passwords for one username from one client address, that pair is refused with 429 for
# MINT_LOGIN_COOLOFF_S seconds. Another failure during the cool-off starts it again, so Retry-After is exact.
MINT_LOGIN_FAILURE_LIMIT = env_int("MINT_LOGIN_FAILURE_LIMIT", 5, minimum=1)
MINT_LOGIN_COOLOFF_S = env_int("MINT_LOGIN_COOLOFF_S", 900, minimum=1)
AXES_FAILURE_LIMIT = MINT_LOGIN_FAILURE_LIMIT
AXES_COOLOFF_TIME = timedelta(seconds=MINT_LOGIN_COOLOFF_S)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
# Counters live in the cache (Redis) and expire with the cool-off, so failures never grow a table.
AXES_HANDLER = "axes.handlers.cache.AxesCacheHandler"
AXES_ENABLE_ADMIN = False  # its admin pages would list the database tables the cache handler leaves empty
# The address is REMOTE_ADDR only: uvicorn already rewrote it from X-Forwarded-For for trusted proxies
# (--forwarded-allow-ips), and any other header is the client's to forge.
AXES_CLIENT_IP_CALLABLE = "frontend.views.auth.login_client_address"
AXES_LOCKOUT_CALLABLE = "frontend.views.auth.login_locked_out"
# A single sign-on callback checks no password (the issuer did): it is neither counted nor locked out.
AXES_WHITELIST_CALLABLE = "frontend.views.auth.not_a_password_attempt"
# A good password clears the count for that username and address (only its owner can do that).
AXES_RESET_ON_SUCCESS = True
# A refused attempt during the cool-off starts it again (django-axes' default, named here because the lockout
# page's Retry-After counts on it).
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = True
