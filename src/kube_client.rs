//! A Kubernetes client as kubectl finds its configuration: shared by the operator and by the
//! sidecar's reading of a quorum restore request (which must not depend on the operator).

/// The kube client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The kubeconfig file could not be read or used.
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        /// The file.
        path: std::path::PathBuf,
        /// What went wrong.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Neither a kubeconfig nor the in-cluster service account could be used.
    #[error("no Kubernetes configuration (kubeconfig or in-cluster): {0}")]
    Infer(#[source] ::kube::config::InferConfigError),
    /// The client could not be built from the configuration.
    #[error("building the Kubernetes client: {0}")]
    Build(#[source] ::kube::Error),
}

/// A client from `kubeconfig` when given (its current context), else from `$KUBECONFIG`,
/// `~/.kube/config` or the in-cluster service account, as kubectl finds them.
pub async fn client(kubeconfig: Option<&std::path::Path>) -> Result<::kube::Client, ClientError> {
    let config = match kubeconfig {
        Some(path) => {
            let err = |e: Box<dyn std::error::Error + Send + Sync>| ClientError::Kubeconfig {
                path: path.to_owned(),
                source: e,
            };
            let kc = ::kube::config::Kubeconfig::read_from(path).map_err(|e| err(Box::new(e)))?;
            ::kube::Config::from_custom_kubeconfig(
                kc,
                &::kube::config::KubeConfigOptions::default(),
            )
            .await
            .map_err(|e| err(Box::new(e)))?
        }
        None => ::kube::Config::infer().await.map_err(ClientError::Infer)?,
    };
    ::kube::Client::try_from(config).map_err(ClientError::Build)
}
