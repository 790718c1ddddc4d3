"""The provider's token validator: DOT's, with claims for the people, and three applications that misbehave on
purpose so that MinT's refusals can be tested against real tokens of a real provider:

- `forger`: its ID tokens name the provider's key id but are signed with another key (a forged signature);
- `other-issuer`: its ID tokens say another issuer issued them (properly signed);
- `wrong-audience`: its ID tokens are meant for another application (`aud`).
"""

import json
import os

from jwcrypto import jwk, jwt
from oauth2_provider.models import AbstractApplication
from oauth2_provider.oauth2_validators import OAuth2Validator

OTHER_ISSUER = "http://other-issuer.invalid"
OTHER_AUDIENCE = "another-application"


class Validator(OAuth2Validator):
    oidc_claim_scope = None  # every claim, whatever the scopes (the suite asks for openid email profile)

    def get_additional_claims(self, request):
        user = request.user
        return {"email": user.email, "email_verified": True, "preferred_username": user.username}

    def get_id_token_dictionary(self, token, token_handler, request):
        claims, expiration_time = super().get_id_token_dictionary(token, token_handler, request)
        if request.client.name == "other-issuer":
            claims["iss"] = OTHER_ISSUER
        if request.client.name == "wrong-audience":
            claims["aud"] = OTHER_AUDIENCE
        return claims, expiration_time

    def finalize_id_token(self, id_token, token, token_handler, request):
        if request.client.name != "forger":
            return super().finalize_id_token(id_token, token, token_handler, request)
        claims, _ = self.get_id_token_dictionary(token, token_handler, request)
        id_token.update(**claims)
        if "nonce" not in id_token and request.nonce:
            id_token["nonce"] = request.nonce
        assert request.client.algorithm == AbstractApplication.RS256_ALGORITHM
        header = {"typ": "JWT", "alg": "RS256", "kid": request.client.jwk_key.thumbprint()}
        with open(os.environ["OIDC_PROVIDER_FORGER_KEY"], "rb") as key_file:
            other_key = jwk.JWK.from_pem(key_file.read())
        token_jwt = jwt.JWT(header=json.dumps(header), claims=json.dumps(id_token, default=str))
        token_jwt.make_signed_token(other_key)
        return token_jwt.serialize()
