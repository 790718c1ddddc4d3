from django.urls import path

from webhooks import apis

urlpatterns = [
    path("webhooks/", apis.WebhookListCreateApi.as_view(), name="api-webhooks"),
    path("webhooks/<int:webhook_id>/", apis.WebhookDetailApi.as_view(), name="api-webhook"),
    path("webhooks/<int:webhook_id>/ping/", apis.WebhookPingApi.as_view(), name="api-webhook-ping"),
    path("webhooks/<int:webhook_id>/deliveries/", apis.WebhookDeliveryListApi.as_view(), name="api-webhook-deliveries"),
    path(
        "webhooks/<int:webhook_id>/deliveries/<int:delivery_id>/redeliver/",
        apis.WebhookRedeliverApi.as_view(),
        name="api-webhook-redeliver",
    ),
]
