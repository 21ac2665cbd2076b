//! `etcd-warden-operator generate-controlplaneset`: an `Inactive` ControlPlaneSet drawn from
//! the control-plane Machines as they are, to review before activating it (as OpenShift's
//! control-plane machine set operator generates its sets).
//!
//! The template is the Machines' provider spec without the failure domain (the spec most of
//! them share, by the set's own comparison; ties go to the first by name), the failure domains
//! are the domains the Machines are in, `replicas` is how many there are (3 or 5), the selector
//! is the one they were found by, and the template's labels are those every Machine carries.
//! Pure: the caller lists the Machines.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde_json::Value;

use super::plan::spec_hash;
use super::resource::{
    ControlPlaneSet, ControlPlaneSetSpec, FailureDomains, MachineTemplate, NAME, Platform,
    ProviderSpec, State, TemplateMachineSpec, TemplateMetadata, UpdateStrategy, template_spec,
};
use crate::operator::kube::set_machines::SET_LABEL;

/// Why no set can be drawn from the Machines.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GenerateError {
    /// Not 3 or 5 Machines (deleting ones left out).
    #[error("{0} control-plane Machines match the selector; a ControlPlaneSet takes over 3 or 5")]
    Count(usize),
    /// A Machine without `spec.providerSpec.value`.
    #[error("machine {0} has no spec.providerSpec.value")]
    NoProviderSpec(String),
    /// The platform could not be told from the provider spec's `kind`.
    #[error("cannot tell the platform from providerSpec kind {0:?}; pass --platform")]
    Platform(String),
    /// Some Machines have a failure domain and some do not.
    #[error("machine {0} has no failure domain where the others have one")]
    MixedDomains(String),
}

/// The platform whose provider spec `kind` this is.
pub fn platform_of(provider: &Value) -> Result<Platform, GenerateError> {
    let kind = provider
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default();
    Ok(match kind {
        "AWSMachineProviderConfig" => Platform::AWS,
        "AzureMachineProviderSpec" => Platform::Azure,
        "GCPMachineProviderSpec" => Platform::GCP,
        "OpenstackProviderSpec" => Platform::OpenStack,
        "VSphereMachineProviderSpec" => Platform::VSphere,
        other => return Err(GenerateError::Platform(other.to_owned())),
    })
}

/// The Inactive set for `machines` (raw Machine objects) found in `namespace` by `selector`;
/// `platform` as given, else told from the provider spec.
pub fn generate(
    namespace: &str,
    selector: &BTreeMap<String, String>,
    machines: &[Value],
    platform: Option<Platform>,
) -> Result<ControlPlaneSet, GenerateError> {
    let name_of = |m: &Value| {
        m.pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let mut live: Vec<&Value> = machines
        .iter()
        .filter(|m| m.pointer("/metadata/deletionTimestamp").is_none())
        .collect();
    live.sort_by_key(|m| name_of(m));
    if !matches!(live.len(), 3 | 5) {
        return Err(GenerateError::Count(live.len()));
    }
    let mut specs = Vec::new();
    for m in &live {
        let value = m
            .pointer("/spec/providerSpec/value")
            .filter(|v| v.is_object())
            .ok_or_else(|| GenerateError::NoProviderSpec(name_of(m)))?;
        specs.push(template_spec(value));
    }
    let platform = match platform {
        Some(p) => p,
        // Every Machine's kind must say the same.
        None => {
            let mut found = None;
            for spec in &specs {
                let p = platform_of(&spec["providerSpec"]["value"])?;
                if found.is_some_and(|f| f != p) {
                    return Err(GenerateError::Platform(format!("{p:?} beside {found:?}")));
                }
                found = Some(p);
            }
            found.unwrap_or(Platform::AWS)
        }
    };
    let field = platform.field();
    // The spec most Machines share (without the domain), the first by name on a tie.
    let hashes: Vec<String> = specs.iter().map(|s| spec_hash(s, field)).collect();
    let best = (0..specs.len())
        .max_by_key(|&i| {
            let n = hashes.iter().filter(|h| **h == hashes[i]).count();
            (n, std::cmp::Reverse(i))
        })
        .unwrap_or(0);
    let provider = field.strip(&specs[best])["providerSpec"]["value"].clone();
    let domains: Vec<Option<String>> = specs.iter().map(|s| field.get(s)).collect();
    let failure_domains = if domains.iter().all(Option::is_none) {
        None
    } else {
        if let Some(i) = domains.iter().position(Option::is_none) {
            return Err(GenerateError::MixedDomains(name_of(live[i])));
        }
        let unique: BTreeSet<String> = domains.into_iter().flatten().collect();
        Some(FailureDomains {
            platform,
            domains: unique.into_iter().collect(),
        })
    };
    let labels_of = |m: &Value| -> BTreeMap<String, String> {
        m.pointer("/metadata/labels")
            .cloned()
            .and_then(|l| serde_json::from_value(l).ok())
            .unwrap_or_default()
    };
    let mut labels = labels_of(live[0]);
    for m in &live[1..] {
        let other = labels_of(m);
        labels.retain(|k, v| other.get(k) == Some(v));
    }
    labels.remove(SET_LABEL);
    labels.extend(selector.clone());
    let spec = ControlPlaneSetSpec {
        state: State::Inactive,
        replicas: i32::try_from(live.len()).unwrap_or(3),
        strategy: UpdateStrategy::default(),
        failure_domains,
        selector: LabelSelector {
            match_labels: Some(selector.clone()),
            match_expressions: None,
        },
        template: MachineTemplate {
            metadata: TemplateMetadata {
                labels,
                annotations: BTreeMap::new(),
            },
            spec: TemplateMachineSpec {
                provider_spec: ProviderSpec { value: provider },
            },
        },
    };
    let mut set = ControlPlaneSet::new(NAME, spec);
    set.metadata.namespace = Some(namespace.to_owned());
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn machine(name: &str, zone: Option<&str>, instance: &str) -> Value {
        let mut placement = json!({"region": "us-east-1"});
        if let Some(z) = zone {
            placement["availabilityZone"] = json!(z);
        }
        json!({
            "metadata": {"name": name, "labels": {
                "machine.openshift.io/cluster-api-machine-role": "master",
                "machine.openshift.io/cluster-api-machine-type": "master",
                "only": name,
            }},
            "spec": {"providerSpec": {"value": {
                "kind": "AWSMachineProviderConfig", "instanceType": instance, "placement": placement,
            }}},
        })
    }

    fn selector() -> BTreeMap<String, String> {
        BTreeMap::from([(
            "machine.openshift.io/cluster-api-machine-role".to_owned(),
            "master".to_owned(),
        )])
    }

    #[test]
    fn an_inactive_set_from_the_machines_template_without_the_domain() {
        let ms = [
            machine("cp-2", Some("us-east-1c"), "m6i.xlarge"),
            machine("cp-0", Some("us-east-1a"), "m6i.xlarge"),
            machine("cp-1", Some("us-east-1b"), "m5.xlarge"),
        ];
        let set = generate("openshift-machine-api", &selector(), &ms, None).unwrap();
        assert_eq!(set.metadata.name.as_deref(), Some(NAME));
        assert_eq!(set.spec.state, State::Inactive);
        assert_eq!(set.spec.replicas, 3);
        let fd = set.spec.failure_domains.clone().unwrap();
        assert_eq!(fd.platform, Platform::AWS);
        assert_eq!(fd.domains, ["us-east-1a", "us-east-1b", "us-east-1c"]);
        assert_eq!(
            set.spec.template.spec.provider_spec.value,
            json!({"kind": "AWSMachineProviderConfig", "instanceType": "m6i.xlarge", "placement": {"region": "us-east-1"}})
        );
        let labels = &set.spec.template.metadata.labels;
        assert_eq!(labels.len(), 2, "{labels:?}");
        // The controller accepts what it generates.
        let raw = serde_json::to_value(&set).unwrap();
        let v = super::super::resource::validate(&raw, None).unwrap();
        assert!(!v.active);
    }

    #[test]
    fn what_cannot_become_a_set_is_refused_naming_why() {
        let two = [machine("a", None, "x"), machine("b", None, "x")];
        assert_eq!(
            generate("ns", &selector(), &two, None).unwrap_err(),
            GenerateError::Count(2)
        );
        let mixed = [
            machine("a", Some("z1"), "x"),
            machine("b", None, "x"),
            machine("c", Some("z2"), "x"),
        ];
        assert_eq!(
            generate("ns", &selector(), &mixed, None).unwrap_err(),
            GenerateError::MixedDomains("b".into())
        );
        let mut odd = machine("c", None, "x");
        odd["spec"]["providerSpec"]["value"]["kind"] = json!("Unknown");
        let ms = [odd, machine("a", None, "x"), machine("b", None, "x")];
        assert!(matches!(
            generate("ns", &selector(), &ms, None),
            Err(GenerateError::Platform(_))
        ));
        assert!(generate("ns", &selector(), &ms, Some(Platform::AWS)).is_ok());
    }
}
