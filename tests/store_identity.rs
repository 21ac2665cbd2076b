//! S3 with a web identity (EKS's IRSA: `store.role_arn` and `store.web_identity_token_file`):
//! the store assumes the role through STS with the token read from the file, and a token
//! rotated on disk is what the next renewal of the credentials sends. S3 is the real s3s-fs on
//! loopback; STS is a stand-in on loopback (no STS server installs here; moto's would need
//! its own S3 too), served over HTTPS with a test CA given as `store.ca_file`, because the
//! client reaches STS over HTTPS only. The stand-in hands out s3s-fs's own keys with an
//! expiry a minute away, inside object_store's five-minute renewal margin, so every request
//! renews them and reads the token file again. Not checked: a real STS's validation of the
//! token (its signature, audience, the role's trust policy).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Query, State};
use axum::routing::post;
use futures::TryStreamExt;
use object_store::{ObjectStore, ObjectStoreExt};

use etcd_warden::config::WebIdentity;
use etcd_warden::store::build_with_env;

use crate::support::s3::{ACCESS_KEY, S3Server, SECRET_KEY};

/// What the stand-in STS was asked: (role, token) per call.
type Calls = Arc<Mutex<Vec<(String, String)>>>;

async fn assume_role(
    State(calls): State<Calls>,
    Query(q): Query<HashMap<String, String>>,
) -> String {
    let role = q.get("RoleArn").cloned().unwrap_or_default();
    let token = q.get("WebIdentityToken").cloned().unwrap_or_default();
    calls.lock().unwrap().push((role, token));
    let expires = (chrono::Utc::now() + chrono::Duration::seconds(60))
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    format!(
        "<AssumeRoleWithWebIdentityResponse><AssumeRoleWithWebIdentityResult><Credentials>\
         <AccessKeyId>{ACCESS_KEY}</AccessKeyId><SecretAccessKey>{SECRET_KEY}</SecretAccessKey>\
         <SessionToken>session</SessionToken><Expiration>{expires}</Expiration>\
         </Credentials></AssumeRoleWithWebIdentityResult></AssumeRoleWithWebIdentityResponse>"
    )
}

/// Serves `app` over https on a loopback port with the test certificates in `certs`; stops when
/// the token is cancelled.
async fn serve_https(
    app: axum::Router,
    certs: &std::path::Path,
) -> (u16, tokio_util::sync::CancellationToken) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let cancel = tokio_util::sync::CancellationToken::new();
    tokio::spawn(etcd_warden::server::serve_tls(
        listener,
        app,
        cancel.clone(),
        etcd_warden::server::ServerTls {
            cert: certs.join("server.pem"),
            key: certs.join("server.key"),
            client_ca: None,
        },
    ));
    (port, cancel)
}

/// A stand-in identity endpoint: test certificates made in `dir`, `route` served at `path` with
/// `state` (where it records what it was asked) over https on loopback; its port, and the token
/// that stops it.
async fn stand_in<S: Clone + Send + Sync + 'static>(
    dir: &std::path::Path,
    path: &str,
    route: axum::routing::MethodRouter<S>,
    state: S,
) -> (u16, tokio_util::sync::CancellationToken) {
    crate::support::tls::make_certs(dir);
    let app = axum::Router::new().route(path, route).with_state(state);
    serve_https(app, dir).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_web_identity_token_rotated_on_disk_is_sent_at_the_next_renewal() {
    let dir = tempfile::tempdir().unwrap();
    let calls: Calls = Arc::default();
    let (port, cancel) = stand_in(dir.path(), "/", post(assume_role), calls.clone()).await;

    let s3 = S3Server::start(&["backups"]);
    let token = dir.path().join("token");
    std::fs::write(&token, "token-1").unwrap();
    let mut config = s3.store_config("backups", "etcd");
    config.access_key_id = None;
    config.secret_access_key = None;
    config.web_identity = Some(WebIdentity {
        role_arn: "arn:aws:iam::123456789012:role/etcd-backup".into(),
        token_file: token.clone(),
        sts_endpoint: Some(format!("https://127.0.0.1:{port}/")),
    });
    config.ca_file = Some(dir.path().join("ca.pem"));
    // No provider variables: the credentials can only come from STS.
    let store = build_with_env(&config, &HashMap::<String, String>::new(), None).unwrap();

    probe(&store, "a write signed with the assumed role's credentials").await;
    {
        let seen = calls.lock().unwrap();
        assert!(!seen.is_empty(), "STS was never asked");
        assert!(
            seen.iter()
                .all(|(r, t)| r.ends_with("role/etcd-backup") && t == "token-1"),
            "{seen:?}"
        );
    }

    // The kubelet rotates the projected token: the next renewal reads the new one.
    rotate_token(&store, &token, "token-2").await;
    let last = calls.lock().unwrap().last().cloned().unwrap();
    assert_eq!(last.1, "token-2");
    cancel.cancel();
}

/// What cannot make a web identity is refused naming the key.
#[test]
fn a_web_identity_needs_both_keys_https_and_an_s3_store() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "t").unwrap();
    let token = token.display().to_string();
    let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (
            vec![("store.url", "s3://b/p"), ("store.role_arn", "arn:r")],
            "store.web_identity_token_file",
        ),
        (
            vec![
                ("store.url", "s3://b/p"),
                ("store.web_identity_token_file", &token),
            ],
            "store.role_arn",
        ),
        (
            vec![
                ("store.url", "s3://b/p"),
                ("store.role_arn", "arn:r"),
                ("store.web_identity_token_file", &token),
                ("store.sts_endpoint", "http://127.0.0.1:1"),
            ],
            "store.sts_endpoint",
        ),
        (
            vec![
                ("store.url", "gs://b/p"),
                ("store.role_arn", "arn:r"),
                ("store.web_identity_token_file", &token),
            ],
            "store.role_arn",
        ),
        (
            vec![
                ("store.url", "s3://b/p"),
                ("store.role_arn", "arn:r"),
                ("store.web_identity_token_file", &token),
                ("store.access_key_id", "a"),
                ("store.secret_access_key", "b"),
            ],
            "store.role_arn",
        ),
        (
            vec![("store.url", "s3://b/p"), ("store.ca_file", &token)],
            "store.ca_file",
        ),
    ];
    refused_naming(&cases);
}

/// Each case's keys are refused, the error naming the case's key.
fn refused_naming(cases: &[(Vec<(&str, &str)>, &str)]) {
    for (keys, named) in cases {
        let e = load(keys).expect_err(named);
        assert_eq!(e.key, *named, "{keys:?}: {e}");
    }
}

/// A write (`what` if it fails) and a listing of exactly it through `store`, which only the
/// credentials its identity exchanged for can sign.
async fn probe(store: &Arc<dyn ObjectStore>, what: &str) {
    store
        .put(&"etcd/v2/probe".into(), "x".into())
        .await
        .expect(what);
    let listed: Vec<_> = store.list(None).try_collect().await.unwrap();
    assert_eq!(listed.len(), 1);
}

/// Writes `next` into the projected token file `token` as the kubelet rotates it, then lists
/// through `store` so that it fetches credentials again (object_store reuses those fetched in
/// the last 100 ms, hence the wait).
async fn rotate_token(store: &Arc<dyn ObjectStore>, token: &std::path::Path, next: &str) {
    std::fs::write(token, next).unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    store.list(None).try_collect::<Vec<_>>().await.unwrap();
}

fn load(
    keys: &[(&str, &str)],
) -> Result<etcd_warden::config::Config, etcd_warden::config::ConfigError> {
    let sources = etcd_warden::config::Sources {
        file: None,
        env: &HashMap::<String, String>::new(),
        overrides: keys
            .iter()
            .map(|(k, v)| etcd_warden::config::Override::flag(k, *v, "test"))
            .collect(),
    };
    etcd_warden::config::Config::load_for(&sources, etcd_warden::config::Purpose::Any)
        .map(|(c, _)| c)
}

/// Server-side encryption and the Azure workload identity: what they take, and what cannot make
/// them refused naming the key.
#[test]
fn encryption_and_azure_identity_keys_are_checked_naming_the_key() {
    use etcd_warden::config::ServerSideEncryption as Sse;
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, bytes: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p.display().to_string()
    };
    let raw = file("raw", &[9u8; 32]);
    let raw_nl = file("raw-nl", &[[9u8; 32].as_slice(), b"\n"].concat());
    let b64 = file("b64", b"CQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQk=\n");
    let short = file("short", b"c2hvcnQ=");
    let token = file("token", b"jwt");
    let want_c = Sse::Customer {
        key_base64: "CQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQk=".into(),
    };
    for (keys, want) in [
        (
            vec![("store.server_side_encryption", "AES256")],
            Sse::S3Managed,
        ),
        (
            vec![
                ("store.server_side_encryption", "aws:kms"),
                ("store.sse_kms_key_id", "alias/etcd"),
            ],
            Sse::Kms {
                key_id: Some("alias/etcd".into()),
                dual: false,
            },
        ),
        (
            vec![("store.server_side_encryption", "aws:kms:dsse")],
            Sse::Kms {
                key_id: None,
                dual: true,
            },
        ),
        (
            vec![
                ("store.server_side_encryption", "sse-c"),
                ("store.sse_customer_key_file", &raw),
            ],
            want_c.clone(),
        ),
        (
            vec![
                ("store.server_side_encryption", "sse-c"),
                ("store.sse_customer_key_file", &raw_nl),
            ],
            want_c.clone(),
        ),
        (
            vec![
                ("store.server_side_encryption", "sse-c"),
                ("store.sse_customer_key_file", &b64),
            ],
            want_c.clone(),
        ),
    ] {
        let mut all = vec![("store.url", "s3://b/p")];
        all.extend(keys.iter().cloned());
        let c = load(&all).unwrap_or_else(|e| panic!("{keys:?}: {e}"));
        assert_eq!(c.store.sse, Some(want), "{keys:?}");
    }
    let identity = [
        ("store.url", "az://c/p"),
        ("store.account_name", "acct"),
        ("store.federated_token_file", token.as_str()),
        ("store.client_id", "client"),
        ("store.tenant_id", "tenant"),
        ("store.authority_host", "https://login.example/"),
    ];
    let c = load(&identity).unwrap();
    let id = c.store.azure_identity.expect("an identity");
    assert_eq!(
        (id.client_id.as_str(), id.tenant_id.as_str()),
        ("client", "tenant")
    );
    assert_eq!(id.authority_host.as_deref(), Some("https://login.example"));

    let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (
            vec![
                ("store.url", "s3://b/p"),
                ("store.server_side_encryption", "kms"),
            ],
            "store.server_side_encryption",
        ),
        (
            vec![
                ("store.url", "gs://b/p"),
                ("store.server_side_encryption", "AES256"),
            ],
            "store.server_side_encryption",
        ),
        (
            vec![("store.url", "s3://b/p"), ("store.sse_kms_key_id", "k")],
            "store.sse_kms_key_id",
        ),
        (
            vec![
                ("store.url", "s3://b/p"),
                ("store.server_side_encryption", "AES256"),
                ("store.sse_kms_key_id", "k"),
            ],
            "store.sse_kms_key_id",
        ),
        (
            vec![
                ("store.url", "s3://b/p"),
                ("store.server_side_encryption", "sse-c"),
            ],
            "store.sse_customer_key_file",
        ),
        (
            vec![
                ("store.url", "s3://b/p"),
                ("store.server_side_encryption", "sse-c"),
                ("store.sse_customer_key_file", &short),
            ],
            "store.sse_customer_key_file",
        ),
        (
            vec![
                ("store.url", "s3://b/p"),
                ("store.server_side_encryption", "aws:kms"),
                ("store.sse_customer_key_file", &raw),
            ],
            "store.sse_customer_key_file",
        ),
        (
            vec![("store.url", "az://c/p"), ("store.client_id", "c")],
            "store.client_id",
        ),
        (
            vec![
                ("store.url", "az://c/p"),
                ("store.federated_token_file", &token),
                ("store.client_id", "c"),
            ],
            "store.tenant_id",
        ),
        (
            vec![
                ("store.url", "s3://b/p"),
                ("store.federated_token_file", &token),
                ("store.client_id", "c"),
                ("store.tenant_id", "t"),
            ],
            "store.federated_token_file",
        ),
        (
            identity
                .iter()
                .cloned()
                .chain([("store.account_key", "a2V5")])
                .collect(),
            "store.federated_token_file",
        ),
        (
            identity
                .iter()
                .cloned()
                .filter(|(k, _)| *k != "store.authority_host")
                .chain([("store.authority_host", "http://login.example")])
                .collect(),
            "store.authority_host",
        ),
        (
            vec![("store.url", "file:///tmp/x"), ("store.ca_file", &token)],
            "store.ca_file",
        ),
    ];
    refused_naming(&cases);
}

/// What the stand-in Entra ID was asked: (tenant, client id, client assertion) per call.
type Exchanges = Arc<Mutex<Vec<(String, String, String)>>>;

/// Entra ID's token endpoint for a federated credential, as a stand-in: it answers with a JWT
/// shaped as Entra ID issues them for Azure Storage (unsigned: azurite checks no signature),
/// valid an hour, but told to expire in a minute, inside object_store's five-minute renewal
/// margin, so every request exchanges the token file again.
async fn entra_token(
    State(seen): State<Exchanges>,
    axum::extract::Path(tenant): axum::extract::Path<String>,
    axum::extract::Form(form): axum::extract::Form<HashMap<String, String>>,
) -> axum::Json<serde_json::Value> {
    let field = |k: &str| form.get(k).cloned().unwrap_or_default();
    assert_eq!(
        field("client_assertion_type"),
        "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
    );
    seen.lock().unwrap().push((
        tenant.clone(),
        field("client_id"),
        field("client_assertion"),
    ));
    use base64::Engine as _;
    let b64 = |v: serde_json::Value| {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
    };
    let now = chrono::Utc::now().timestamp();
    let jwt = format!(
        "{}.{}.c2ln",
        b64(serde_json::json!({"alg": "RS256", "typ": "JWT"})),
        b64(serde_json::json!({
            "aud": "https://storage.azure.com",
            "iss": format!("https://sts.windows.net/{tenant}/"),
            "tid": tenant,
            "appid": field("client_id"),
            "iat": now - 60, "nbf": now - 60, "exp": now + 3600,
        }))
    );
    axum::Json(serde_json::json!({
        "access_token": jwt, "token_type": "Bearer", "expires_in": 60,
    }))
}

/// Azure with a workload identity (AKS's: `store.client_id`, `store.tenant_id`,
/// `store.federated_token_file`, `store.authority_host`): the projected token is exchanged at
/// Entra ID for a storage token, read again at every exchange, and the storage token is what
/// the blob service gets. The blob service is the real azurite over https with `--oauth basic`,
/// which refuses a request without a bearer token it accepts; Entra ID is a stand-in on
/// loopback over https (the same test CA, `store.ca_file`). Not checked: Entra ID's validation
/// of the federated token and the token's signature (azurite checks audience, issuer and
/// lifetime only).
#[tokio::test(flavor = "multi_thread")]
async fn an_azure_workload_identity_token_rotated_on_disk_is_exchanged_again() {
    let dir = tempfile::tempdir().unwrap();
    let exchanges: Exchanges = Arc::default();
    let (port, cancel) = stand_in(
        dir.path(),
        "/{tenant}/oauth2/v2.0/token",
        post(entra_token),
        exchanges.clone(),
    )
    .await;
    let azurite = crate::support::azurite::Azurite::start_oauth(
        &dir.path().join("server.pem"),
        &dir.path().join("server.key"),
    );
    let ca =
        reqwest::Certificate::from_pem(&std::fs::read(dir.path().join("ca.pem")).unwrap()).unwrap();
    let trusting = reqwest::Client::builder()
        .add_root_certificate(ca)
        .build()
        .unwrap();
    azurite
        .create_container_with("etcd-backups", &trusting)
        .await;

    let token = dir.path().join("azure-identity-token");
    std::fs::write(&token, "federated-1").unwrap();
    let keys = [
        ("store.url", "az://etcd-backups/etcd".to_string()),
        ("store.use_emulator", "true".into()),
        ("store.endpoint", azurite.endpoint()),
        (
            "store.ca_file",
            dir.path().join("ca.pem").display().to_string(),
        ),
        ("store.client_id", "etcd-backup-client".into()),
        ("store.tenant_id", "tenant-1".into()),
        ("store.federated_token_file", token.display().to_string()),
        ("store.authority_host", format!("https://127.0.0.1:{port}")),
    ];
    let keys: Vec<(&str, &str)> = keys.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let config = load(&keys).unwrap().store;
    let store = build_with_env(&config, &HashMap::<String, String>::new(), None).unwrap();

    probe(&store, "a write with the exchanged token").await;
    {
        let seen = exchanges.lock().unwrap();
        assert!(!seen.is_empty(), "Entra ID was never asked");
        assert!(
            seen.iter().all(|e| e
                == &(
                    "tenant-1".to_string(),
                    "etcd-backup-client".to_string(),
                    "federated-1".to_string()
                )),
            "{seen:?}"
        );
    }

    // The kubelet rotates the projected token: the next exchange sends the new one.
    rotate_token(&store, &token, "federated-2").await;
    let last = exchanges.lock().unwrap().last().cloned().unwrap();
    assert_eq!(last.2, "federated-2");

    // Without the identity azurite refuses: the token is what authenticates.
    let mut anonymous = config.clone();
    anonymous.azure_identity = None;
    anonymous.account_key = Some(etcd_warden::config::Secret::Value(
        "bm90IHRoZSBrZXk=".into(),
    ));
    let refused = build_with_env(&anonymous, &HashMap::<String, String>::new(), None).unwrap();
    assert!(
        refused.list(None).try_collect::<Vec<_>>().await.is_err(),
        "azurite accepted a wrong key"
    );
    cancel.cancel();
}

/// How often the stand-in metadata server handed out a token, and the last one.
type Handed = Arc<Mutex<u32>>;

/// GCE's metadata server as GKE's workload identity serves it: a token for the pod's Google
/// service account, to a caller that says `Metadata-Flavor: Google`, expiring in a minute
/// (inside object_store's renewal margin, so each request asks again).
async fn metadata_token(
    State(handed): State<Handed>,
    headers: axum::http::HeaderMap,
) -> Result<axum::Json<serde_json::Value>, axum::http::StatusCode> {
    if headers.get("metadata-flavor").and_then(|v| v.to_str().ok()) != Some("Google") {
        return Err(axum::http::StatusCode::FORBIDDEN);
    }
    let mut n = handed.lock().unwrap();
    *n += 1;
    Ok(axum::Json(serde_json::json!({
        "access_token": format!("gke-token-{n}"), "token_type": "Bearer", "expires_in": 60,
    })))
}

/// GCS with GKE's workload identity: no key configured, so `etcd-warden snapshot` and `ls` ask
/// the metadata server for the pod's token and send it as the bearer of every request to GCS's
/// XML API. The metadata server is a stand-in on loopback (object_store reads its address from
/// `GCE_METADATA_HOST`, as Google's libraries do); GCS is stood in for by moto's S3, whose API
/// GCS's XML API shares for what etcd-warden does (put, multipart upload, list, get), behind a
/// proxy that records the bearer and replaces it with what moto takes. Not checked: GCS's own
/// answers where they differ from S3's, and Google's validation of the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcs_with_gkes_workload_identity_sends_the_metadata_servers_token() {
    use crate::support::etcd::{EtcdCluster, Release};
    let etcd = EtcdCluster::single(Release::V35).await;
    let moto = crate::support::moto::MotoServer::with_buckets(&["gcs-backups"]).await;
    let gcs = crate::support::recorder::Recorder::start(
        &moto.endpoint(),
        Some(crate::support::moto::ANY_SIGNATURE),
    )
    .await;
    let handed: Handed = Arc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metadata = listener.local_addr().unwrap();
    let app = axum::Router::new()
        .route(
            "/computeMetadata/v1/instance/service-accounts/default/token",
            axum::routing::get(metadata_token),
        )
        .with_state(handed.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let home = tempfile::tempdir().unwrap(); // no gcloud credentials file to find

    let run = |subcommand: &str| {
        let mut c = crate::support::warden::command();
        c.arg(subcommand)
            .env("HOME", home.path())
            .env("GCE_METADATA_HOST", metadata.to_string())
            .env("GCE_METADATA_IP", metadata.to_string())
            .envs(
                [
                    ("store.url", "gs://gcs-backups/etcd".to_string()),
                    ("store.endpoint", gcs.endpoint()),
                    ("etcd.endpoints", etcd.endpoints()[0].clone()),
                ]
                .map(|(k, v)| (etcd_warden::config::env_var_for(k), v)),
            );
        c.output().unwrap()
    };
    for subcommand in ["snapshot", "ls"] {
        let out = run(subcommand);
        assert!(
            out.status.success(),
            "{subcommand}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if subcommand == "ls" {
            assert!(
                String::from_utf8_lossy(&out.stdout).contains("Full-"),
                "{}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
    }
    let requests = gcs.requests();
    assert!(
        requests
            .iter()
            .any(|r| r.method == "PUT" || r.method == "POST"),
        "nothing written: {requests:?}"
    );
    let handed = *handed.lock().unwrap();
    assert!(
        handed >= 2,
        "the metadata server handed out {handed} tokens"
    );
    for r in &requests {
        let bearer = r.header("authorization").unwrap_or_default();
        assert!(
            bearer.starts_with("Bearer gke-token-"),
            "{} {}: {bearer:?}",
            r.method,
            r.path
        );
    }
}
