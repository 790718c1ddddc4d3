"""The OpenAI-compatible routes, included at `/v1/` by mint_site/urls.py."""

from django.urls import path

from serving.gateway import views

urlpatterns = [
    path("models", views.models, name="gateway-models"),
    path("models/<path:model>", views.model_detail, name="gateway-model-detail"),
    path("completions", views.completions, name="gateway-completions"),
    path("chat/completions", views.chat_completions, name="gateway-chat-completions"),
]
