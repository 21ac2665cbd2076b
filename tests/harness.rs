//! Proves the test harness: every fixture is a real server that answers real clients.

use crate::support;

use std::time::Duration;

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use support::etcd::{EtcdCluster, Release};
use support::s3::S3Server;

#[tokio::test]
async fn s3_server_put_list_get_delete_in_two_buckets() {
    let s3 = S3Server::start(&["source-bkt", "dest-bkt"]);
    let src = s3.object_store("source-bkt");
    let dst = s3.object_store("dest-bkt");

    let key = Path::from("prefix/v2/Full-00000000-00000010-1700000000.gz");
    src.put(&key, PutPayload::from_static(b"hello"))
        .await
        .unwrap();
    // Multipart, which full snapshots use: two parts of 5 MiB + a tail.
    let big = Path::from("prefix/v2/big");
    let mut upload = src.put_multipart(&big).await.unwrap();
    let part = vec![7u8; 5 * 1024 * 1024];
    upload
        .put_part(PutPayload::from(part.clone()))
        .await
        .unwrap();
    upload
        .put_part(PutPayload::from(part.clone()))
        .await
        .unwrap();
    upload
        .put_part(PutPayload::from_static(b"tail"))
        .await
        .unwrap();
    upload.complete().await.unwrap();

    let listed: Vec<_> = src
        .list(Some(&Path::from("prefix")))
        .try_collect()
        .await
        .unwrap();
    let mut names: Vec<_> = listed.iter().map(|m| m.location.to_string()).collect();
    names.sort();
    let mut want = vec![big.to_string(), key.to_string()];
    want.sort();
    assert_eq!(names, want);
    assert_eq!(
        listed.iter().find(|m| m.location == big).unwrap().size,
        10 * 1024 * 1024 + 4
    );

    let got = src.get(&key).await.unwrap().bytes().await.unwrap();
    assert_eq!(&got[..], b"hello");
    // Buckets are separate.
    assert!(dst.get(&key).await.is_err());

    src.delete(&key).await.unwrap();
    let err = src.get(&key).await.unwrap_err();
    assert!(
        matches!(err, object_store::Error::NotFound { .. }),
        "{err:?}"
    );
}

#[tokio::test]
async fn s3_server_stops_and_resumes_with_its_data() {
    let mut s3 = S3Server::start(&["outage-bkt"]);
    let store = s3.object_store("outage-bkt");
    store
        .put(&Path::from("k"), PutPayload::from_static(b"v"))
        .await
        .unwrap();
    s3.stop();
    assert!(
        store.get(&Path::from("k")).await.is_err(),
        "a stopped server must not answer"
    );
    s3.resume();
    let got = store
        .get(&Path::from("k"))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(&got[..], b"v");
}

async fn three_member_put_get(release: Release) {
    let cluster = EtcdCluster::start(3, release).await;
    let mut client = cluster.client().await;
    let members = client.member_list().await.unwrap();
    assert_eq!(
        members.members().len(),
        3,
        "{release:?}: three voting members"
    );
    assert!(members.members().iter().all(|m| !m.is_learner()));

    client.put("greeting", "hello", None).await.unwrap();
    // Read it back through each member on its own.
    for m in &cluster.members {
        let mut one = etcd_client::Client::connect([m.client_url()], None)
            .await
            .unwrap();
        let got = one.get("greeting", None).await.unwrap();
        assert_eq!(
            got.kvs()[0].value(),
            b"hello",
            "{release:?}: read via {}",
            m.name
        );
    }
}

#[tokio::test]
async fn etcd_35_three_member_cluster_put_get() {
    three_member_put_get(Release::V35).await;
}

#[tokio::test]
async fn etcd_34_three_member_cluster_put_get() {
    three_member_put_get(Release::V34).await;
}

/// Needs `$ETCD36_BIN_DIR` (skipped without it, as in CI).
#[tokio::test]
async fn etcd_36_three_member_cluster_put_get() {
    if let Some(release) = Release::v36("etcd_36_three_member_cluster_put_get") {
        three_member_put_get(release).await;
    }
}

#[tokio::test]
async fn etcd_member_restarts_on_its_data() {
    let mut cluster = EtcdCluster::single(Release::V35).await;
    let mut client = cluster.client().await;
    client.put("k", "v", None).await.unwrap();
    cluster.members[0].kill();
    assert!(!cluster.members[0].is_running());
    cluster.members[0].start();
    cluster.wait_healthy(Duration::from_secs(20)).await;
    let mut client = cluster.client().await;
    assert_eq!(client.get("k", None).await.unwrap().kvs()[0].value(), b"v");
    assert!(
        Release::V35.bin("etcdutl").is_file(),
        "etcd 3.5 carries etcdutl"
    );
}
