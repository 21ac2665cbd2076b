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

#[tokio::test(flavor = "multi_thread")]
async fn a_web_identity_token_rotated_on_disk_is_sent_at_the_next_renewal() {
    let dir = tempfile::tempdir().unwrap();
    crate::support::tls::make_certs(dir.path());
    let calls: Calls = Arc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let sts = axum::Router::new()
        .route("/", post(assume_role))
        .with_state(calls.clone());
    let cancel = tokio_util::sync::CancellationToken::new();
    tokio::spawn(etcd_warden::server::serve_tls(
        listener,
        sts,
        cancel.clone(),
        etcd_warden::server::ServerTls {
            cert: dir.path().join("server.pem"),
            key: dir.path().join("server.key"),
            client_ca: None,
        },
    ));

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

    store
        .put(&"etcd/v2/probe".into(), "x".into())
        .await
        .expect("a write signed with the assumed role's credentials");
    let listed: Vec<_> = store.list(None).try_collect().await.unwrap();
    assert_eq!(listed.len(), 1);
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
    std::fs::write(&token, "token-2").unwrap();
    // object_store reuses credentials fetched in the last 100 ms.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    store.list(None).try_collect::<Vec<_>>().await.unwrap();
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
    for (keys, named) in cases {
        let sources = etcd_warden::config::Sources {
            file: None,
            env: &HashMap::<String, String>::new(),
            overrides: keys
                .iter()
                .map(|(k, v)| etcd_warden::config::Override::flag(k, *v, "test"))
                .collect(),
        };
        let e = etcd_warden::config::Config::load_for(&sources, etcd_warden::config::Purpose::Any)
            .expect_err(named);
        assert_eq!(e.key, named, "{keys:?}: {e}");
    }
}
