//! The `ControlPlaneSet` custom resource (`etcd-warden.io/v1alpha1`, namespaced, a singleton
//! named `cluster` in the Machines' namespace), its validation, and its mapping onto the
//! planner's [`SetConfig`].
//!
//! The schema carries the rules a real API server enforces (OpenAPI enums, defaults and CEL
//! `x-kubernetes-validations`): `replicas` 3 or 5 and immutable, `selector` immutable and
//! matching the template's labels, the name `cluster`. [`validate`] makes the same checks in the
//! controller, for API servers that skip them (and the test double, which evaluates no CEL): a
//! violation becomes a `Degraded` condition naming the field, and nothing is acted on. What
//! "immutable" compares against is [`AcceptedSpec`], kept in the status, so the check survives
//! a restart of the operator.
//!
//! Failure domains are `{platform, domains: [names]}`: the platform picks where the domain goes
//! in the provider spec ([`Platform::field`], e.g. AWS `placement.availabilityZone`), the names
//! are injected there. Another platform is one more [`Platform`] variant and [`DomainField`].
//!
//! A Machine is up to date when its `providerSpec` (failure domain left out) hashes like the
//! template's, as OpenShift's control-plane machine set compares: the other MachineSpec fields
//! (`lifecycleHooks`, `providerID`, taints) are written by others and are not templated.
//!
//! ```yaml
//! apiVersion: etcd-warden.io/v1alpha1
//! kind: ControlPlaneSet
//! metadata: {name: cluster, namespace: openshift-machine-api}
//! spec:
//!   state: Active                     # or Inactive (observes, never acts); Inactive → Active only
//!   replicas: 3                       # 3 or 5, immutable
//!   strategy: {type: RollingUpdate}   # or Recreate, OnDelete
//!   failureDomains:
//!     platform: AWS                   # the zone goes to providerSpec.value.placement.availabilityZone
//!     domains: [us-east-1a, us-east-1b, us-east-1c]
//!   selector:                         # immutable; must match the template's labels
//!     matchLabels: {machine.openshift.io/cluster-api-machine-role: master}
//!   template:
//!     metadata:
//!       labels: {machine.openshift.io/cluster-api-machine-role: master}
//!     spec:
//!       providerSpec:
//!         value: {instanceType: m6i.xlarge, placement: {region: us-east-1}}
//! ```
//!
//! The quorum operator must order membership changes the way the strategy needs
//! ([`fits_quorum_operator`]: RollingUpdate needs `Replacement::Surge`), else the set refuses
//! to act with reason `QuorumOperatorMismatch`.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    Condition as MetaCondition, LabelSelector, Time,
};
use kube::{CustomResource, KubeSchema};
use schemars::json_schema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::controller::SetConfig;
use super::plan::{Condition, Counts, DomainField, Strategy};

/// The only name a ControlPlaneSet may have.
pub const NAME: &str = "cluster";
/// The finalizer that orphans the Machines before the set goes.
pub const FINALIZER: &str = "etcd-warden.io/orphan-machines";

/// Desired state of the control-plane Machines (seed 004).
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "etcd-warden.io",
    version = "v1alpha1",
    kind = "ControlPlaneSet",
    namespaced,
    status = "ControlPlaneSetStatus",
    shortname = "cps",
    doc = "Keeps 3 or 5 control-plane Machines at a template, spread over failure domains, replaced without risking etcd quorum",
    validation = Rule::new("self.metadata.name == 'cluster'").message("metadata.name: a ControlPlaneSet is a singleton named 'cluster'"),
    printcolumn(name = "Desired", type_ = "integer", json_path = ".spec.replicas"),
    printcolumn(name = "Current", type_ = "integer", json_path = ".status.replicas"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas"),
    printcolumn(name = "Updated", type_ = "integer", json_path = ".status.updatedReplicas"),
    printcolumn(name = "Unavailable", type_ = "integer", json_path = ".status.unavailableReplicas"),
    printcolumn(name = "Strategy", type_ = "string", json_path = ".spec.strategy.type"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[x_kube(validation = Rule::new(
    "!has(self.selector.matchLabels) || self.selector.matchLabels.all(k, has(self.template.metadata.labels) && k in self.template.metadata.labels && self.template.metadata.labels[k] == self.selector.matchLabels[k])"
).message("spec.selector: must match spec.template.metadata.labels"))]
#[x_kube(validation = Rule::new(
    "!has(self.selector.matchExpressions) || self.selector.matchExpressions.all(e, has(self.template.metadata.labels) && e.key in self.template.metadata.labels ? (e.operator == 'In' ? has(e.values) && self.template.metadata.labels[e.key] in e.values : e.operator == 'NotIn' ? !has(e.values) || !(self.template.metadata.labels[e.key] in e.values) : e.operator == 'Exists') : (e.operator == 'NotIn' || e.operator == 'DoesNotExist'))"
).message("spec.selector: matchExpressions must match spec.template.metadata.labels"))]
#[serde(rename_all = "camelCase")]
pub struct ControlPlaneSetSpec {
    /// `Active` (default) acts on the Machines; `Inactive` observes and reports status but
    /// never creates, deletes or patches a Machine. Inactive → Active only.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self == oldSelf || self == 'Active'").message("spec.state: an Active set cannot go back to Inactive"))]
    pub state: State,
    /// Control-plane Machines: 3 or 5. Immutable.
    #[serde(default = "default_replicas")]
    #[schemars(schema_with = "three_or_five")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.replicas is immutable"))]
    pub replicas: i32,
    /// How Machines whose spec differs from the template are replaced.
    #[serde(default)]
    pub strategy: UpdateStrategy,
    /// Where the Machines go; absent: one domain, whatever the template says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domains: Option<FailureDomains>,
    /// Selects the Machines of the set; must match the template's labels. Immutable.
    #[schemars(schema_with = "bounded_selector")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.selector is immutable"))]
    pub selector: LabelSelector,
    /// What new Machines are made from.
    pub template: MachineTemplate,
}

fn default_replicas() -> i32 {
    3
}

/// Longest label value Kubernetes accepts.
pub const LABEL_VALUE_MAX: u32 = 63;
/// Longest label key Kubernetes accepts: a DNS-subdomain prefix (253), `/`, a name (63).
pub const LABEL_KEY_MAX: u32 = 253 + 1 + 63;
/// Most labels in `spec.selector.matchLabels`.
pub const SELECTOR_LABELS_MAX: u32 = 32;
/// Most requirements in `spec.selector.matchExpressions`.
pub const SELECTOR_EXPRESSIONS_MAX: u32 = 32;
/// Most values in one `matchExpressions` requirement.
pub const SELECTOR_VALUES_MAX: u32 = 64;
/// Most labels in `spec.template.metadata.labels`.
pub const TEMPLATE_LABELS_MAX: u32 = 64;

// A real API server estimates the cost of every CEL rule from the schema it reaches and refuses
// the CRD when the worst case is over budget: an unbounded list, map or string counts as large
// as a request can make it (3 MiB). So every list, map and string a rule reaches is bounded
// here, by Kubernetes' own limits where it has one (label keys and values); tests/manifests.rs
// walks the generated schema and fails on a rule that reaches an unbounded field.

/// A map of label values (keys cannot carry a `maxLength` in a structural schema; the map's
/// `maxProperties` bounds them for the cost estimate, the API server bounds them on Machines).
fn label_map(max: u32) -> schemars::Schema {
    json_schema!({
        "type": "object",
        "maxProperties": max,
        "additionalProperties": {"type": "string", "maxLength": LABEL_VALUE_MAX},
    })
}

/// `spec.template.metadata.labels`.
fn template_labels(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    label_map(TEMPLATE_LABELS_MAX)
}

/// metav1.LabelSelector with every list, map and string bounded (see above).
fn bounded_selector(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let mut match_labels = label_map(SELECTOR_LABELS_MAX);
    match_labels.insert(
        "description".into(),
        json!("matchLabels is a map of {key,value} pairs, ANDed, each equivalent to a matchExpressions requirement with operator In and that one value."),
    );
    json_schema!({
        "type": "object",
        "properties": {
            "matchLabels": match_labels,
            "matchExpressions": {
                "description": "matchExpressions is a list of label selector requirements. The requirements are ANDed.",
                "type": "array",
                "maxItems": SELECTOR_EXPRESSIONS_MAX,
                "items": {
                    "description": "A label selector requirement: a key, an operator and values.",
                    "type": "object",
                    "required": ["key", "operator"],
                    "properties": {
                        "key": {
                            "description": "key is the label key that the selector applies to.",
                            "type": "string",
                            "maxLength": LABEL_KEY_MAX,
                        },
                        "operator": {
                            "description": "operator is In, NotIn, Exists or DoesNotExist.",
                            "type": "string",
                            "enum": ["In", "NotIn", "Exists", "DoesNotExist"],
                        },
                        "values": {
                            "description": "values: non-empty for In and NotIn, empty for Exists and DoesNotExist.",
                            "type": "array",
                            "maxItems": SELECTOR_VALUES_MAX,
                            "items": {"type": "string", "maxLength": LABEL_VALUE_MAX},
                        },
                    },
                },
            },
        },
    })
}

/// An integer enum keeps its `type` (a structural schema needs one on every field).
fn three_or_five(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    json_schema!({"type": "integer", "format": "int32", "enum": [3, 5]})
}

/// `spec.state`. Absent means `Active`: a set created before the field existed was acting and
/// keeps acting (a default of `Inactive` would stop it on upgrade, and the transition rule
/// would then forbid nothing but let it be re-activated by hand); a set to review before it
/// acts is written `Inactive` explicitly, as `etcd-warden-operator generate-controlplaneset`
/// does (OpenShift's control-plane machine set generates its sets `Inactive` the same way).
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, schemars::JsonSchema,
)]
pub enum State {
    /// Acts on the Machines.
    #[default]
    Active,
    /// Observes and reports only.
    Inactive,
}

/// `spec.strategy`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, schemars::JsonSchema)]
pub struct UpdateStrategy {
    /// `RollingUpdate` (default), `Recreate` or `OnDelete`.
    #[serde(rename = "type", default)]
    pub kind: Strategy,
}

/// `spec.failureDomains`: the platform (where the domain goes in the provider spec) and the
/// domain names.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
pub struct FailureDomains {
    /// Whose provider spec layout: AWS, Azure, GCP, OpenStack, VSphere.
    pub platform: Platform,
    /// Domain names (AWS: availability zones), each used equally.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub domains: Vec<String>,
}

/// A platform, for where its provider spec keeps the failure domain.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum Platform {
    /// `providerSpec.value.placement.availabilityZone`.
    AWS,
    /// `providerSpec.value.zone`.
    Azure,
    /// `providerSpec.value.zone`.
    GCP,
    /// `providerSpec.value.availabilityZone`.
    OpenStack,
    /// `providerSpec.value.workspace.datacenter`.
    VSphere,
}

impl Platform {
    /// Where the failure domain goes.
    pub fn field(self) -> DomainField {
        match self {
            Platform::AWS => DomainField::AWS,
            Platform::Azure | Platform::GCP => DomainField::ZONE,
            Platform::OpenStack => DomainField::OPENSTACK,
            Platform::VSphere => DomainField::VSPHERE,
        }
    }
}

/// `spec.template`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
pub struct MachineTemplate {
    /// Labels and annotations of new Machines.
    #[serde(default)]
    pub metadata: TemplateMetadata,
    /// The Machine spec of new Machines.
    pub spec: TemplateMachineSpec,
}

/// `spec.template.metadata`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, schemars::JsonSchema)]
pub struct TemplateMetadata {
    /// Labels of new Machines (the selector must match them).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "template_labels")]
    pub labels: BTreeMap<String, String>,
    /// Annotations of new Machines.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// `spec.template.spec`: a MachineSpec reduced to what is templated.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateMachineSpec {
    /// The provider's spec.
    pub provider_spec: ProviderSpec,
}

/// `providerSpec`: the provider's own object, kept as it is written.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
pub struct ProviderSpec {
    /// Free-form provider configuration (e.g. `AWSMachineProviderConfig`).
    #[schemars(schema_with = "free_form")]
    pub value: Value,
}

fn free_form(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    json_schema!({"type": "object", "x-kubernetes-preserve-unknown-fields": true})
}

/// Observed state (seed 004), written only through the status subresource.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ControlPlaneSetStatus {
    /// The generation the counts and conditions are of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Machines of the set, deleting ones included.
    #[serde(default)]
    pub replicas: i32,
    /// Machines not being deleted whose node is Ready.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Machines not being deleted whose spec matches the template.
    #[serde(default)]
    pub updated_replicas: i32,
    /// Desired replicas minus Ready ones (never negative).
    #[serde(default)]
    pub unavailable_replicas: i32,
    /// Available, Progressing, Degraded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<MetaCondition>,
    /// The immutable fields as first accepted; a spec that changes them is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted: Option<AcceptedSpec>,
}

/// The immutable fields of the spec, as the controller first accepted them.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
pub struct AcceptedSpec {
    /// `spec.replicas`.
    pub replicas: i32,
    /// `spec.selector`.
    pub selector: LabelSelector,
    /// `spec.state` as last accepted (absent: before the field existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<State>,
}

/// A spec the controller refuses: the field and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Invalid {
    /// The Degraded condition's reason: `InvalidSpec`, `QuorumOperatorMismatch`, `StatusUnreadable`, or
    /// `MachineActionRefused` (a Machine change the API server refused for good).
    pub reason: &'static str,
    /// The offending field, as a path (`spec.replicas`).
    pub field: String,
    /// Why.
    pub message: String,
}

fn invalid(field: &str, message: impl Into<String>) -> Invalid {
    Invalid {
        reason: "InvalidSpec",
        field: field.to_owned(),
        message: message.into(),
    }
}

/// Whether a set seen for the first time fits the control plane it takes over: as many
/// Machines (not being deleted) as `replicas`. Seed 004: the set does not scale the control
/// plane, and with no Machine at all (a cluster whose control plane the Machine API does not
/// describe) it must not invent one.
pub fn fits_existing(replicas: usize, existing: usize) -> Result<(), Invalid> {
    if existing == replicas {
        return Ok(());
    }
    Err(invalid(
        "spec.replicas",
        format!(
            "is {replicas} but {existing} control-plane Machines match spec.selector; a ControlPlaneSet takes over the control plane at its size and never resizes it"
        ),
    ))
}

/// Whether the quorum operator, ordering a replacement's membership changes by `replacement`,
/// can carry out `strategy`: a RollingUpdate waits for the new member to vote, which only a
/// surging quorum operator does before the old Machine is deleted; a mismatch would stall the
/// set or surprise the operator, so the set refuses to act and says so.
pub fn fits_quorum_operator(
    strategy: Strategy,
    replacement: crate::operator::quorum::plan::Replacement,
) -> Result<(), Invalid> {
    let needed = super::controller::replacement_for(strategy);
    if needed == replacement {
        return Ok(());
    }
    Err(Invalid {
        reason: "QuorumOperatorMismatch",
        field: "spec.strategy.type".into(),
        message: format!(
            "{strategy:?} needs the quorum operator's replacement order {needed:?}; it runs with {replacement:?}"
        ),
    })
}

/// What the controller runs a valid set with.
#[derive(Debug, Clone, PartialEq)]
pub struct Valid {
    /// The planner's configuration.
    pub config: SetConfig,
    /// Where the failure domain goes.
    pub field: DomainField,
    /// The selector as a list query (`k=v,k in (a,b)`).
    pub selector: String,
    /// What goes into the status as accepted.
    pub accepted: AcceptedSpec,
    /// Labels and annotations of new Machines.
    pub metadata: TemplateMetadata,
    /// Whether the set acts (`spec.state: Active`).
    pub active: bool,
}

/// Checks a set as read (raw JSON, so a bad enum is reported with its path rather than failing
/// the read) against the rules of the schema, with `accepted` the immutable fields as first
/// accepted (`None` on first sight).
pub fn validate(raw: &Value, accepted: Option<&AcceptedSpec>) -> Result<Valid, Invalid> {
    let name = raw.pointer("/metadata/name").and_then(Value::as_str);
    if name != Some(NAME) {
        return Err(invalid(
            "metadata.name",
            format!(
                "a ControlPlaneSet is a singleton named '{NAME}', not '{}'",
                name.unwrap_or("")
            ),
        ));
    }
    let spec_raw = raw.get("spec").cloned().unwrap_or(Value::Null);
    let spec: ControlPlaneSetSpec = serde_path_to_error::deserialize(spec_raw).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." {
            "spec".to_owned()
        } else {
            format!("spec.{path}")
        };
        Invalid {
            reason: "InvalidSpec",
            field,
            message: e.into_inner().to_string(),
        }
    })?;
    if !matches!(spec.replicas, 3 | 5) {
        return Err(invalid(
            "spec.replicas",
            format!("must be 3 or 5, got {}", spec.replicas),
        ));
    }
    if let Some(a) = accepted {
        if a.replicas != spec.replicas {
            return Err(invalid(
                "spec.replicas",
                format!(
                    "is immutable: accepted {}, now {}",
                    a.replicas, spec.replicas
                ),
            ));
        }
        if a.state == Some(State::Active) && spec.state == State::Inactive {
            return Err(invalid(
                "spec.state",
                "an Active set cannot go back to Inactive (delete it and create an Inactive one)",
            ));
        }
        if a.selector != spec.selector {
            return Err(invalid(
                "spec.selector",
                format!(
                    "is immutable: accepted {}, now {}",
                    selector_query(&a.selector).unwrap_or_default(),
                    selector_query(&spec.selector).unwrap_or_default()
                ),
            ));
        }
    }
    let selector = selector_query(&spec.selector).map_err(|m| invalid("spec.selector", m))?;
    if selector.is_empty() {
        return Err(invalid(
            "spec.selector",
            "must not be empty: it would select every Machine",
        ));
    }
    if !selector_matches(&spec.selector, &spec.template.metadata.labels) {
        return Err(invalid(
            "spec.selector",
            "does not match spec.template.metadata.labels: new Machines would not belong to the set",
        ));
    }
    if !spec.template.spec.provider_spec.value.is_object() {
        return Err(invalid(
            "spec.template.spec.providerSpec.value",
            "must be an object",
        ));
    }
    let (field, domains) = match &spec.failure_domains {
        Some(f) => {
            let mut seen = std::collections::BTreeSet::new();
            for d in &f.domains {
                if d.is_empty() {
                    return Err(invalid(
                        "spec.failureDomains.domains",
                        "a name must not be empty",
                    ));
                }
                if !seen.insert(d) {
                    return Err(invalid(
                        "spec.failureDomains.domains",
                        format!("{d} is listed twice"),
                    ));
                }
            }
            (f.platform.field(), f.domains.clone())
        }
        None => (DomainField::AWS, Vec::new()),
    };
    let replicas = usize::try_from(spec.replicas).unwrap_or(0);
    Ok(Valid {
        config: SetConfig {
            replicas,
            strategy: spec.strategy.kind,
            failure_domains: domains,
            template: template_spec(&spec.template.spec.provider_spec.value),
        },
        field,
        selector,
        accepted: AcceptedSpec {
            replicas: spec.replicas,
            selector: spec.selector,
            state: Some(spec.state),
        },
        metadata: spec.template.metadata,
        active: spec.state == State::Active,
    })
}

/// The Machine spec the planner compares and new Machines get: the provider spec only.
pub fn template_spec(provider_value: &Value) -> Value {
    json!({"providerSpec": {"value": provider_value}})
}

/// `selector` as a list query; an unknown operator or a malformed expression is an error.
pub fn selector_query(selector: &LabelSelector) -> Result<String, String> {
    let mut parts: Vec<String> = selector
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for (i, e) in selector.match_expressions.iter().flatten().enumerate() {
        let values = e.values.clone().unwrap_or_default();
        let at = format!("matchExpressions[{i}]");
        parts.push(match e.operator.as_str() {
            "In" | "NotIn" if values.is_empty() => {
                return Err(format!("{at}: {} needs values", e.operator));
            }
            "In" => format!("{} in ({})", e.key, values.join(",")),
            "NotIn" => format!("{} notin ({})", e.key, values.join(",")),
            "Exists" => e.key.clone(),
            "DoesNotExist" => format!("!{}", e.key),
            other => {
                return Err(format!(
                    "{at}: operator must be In, NotIn, Exists or DoesNotExist, got {other}"
                ));
            }
        });
    }
    Ok(parts.join(","))
}

/// Whether `labels` match `selector` (as the API server matches a list query).
pub fn selector_matches(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let by_labels = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let by_expressions = selector.match_expressions.iter().flatten().all(|e| {
        let values = e.values.clone().unwrap_or_default();
        let got = labels.get(&e.key);
        match e.operator.as_str() {
            "In" => got.is_some_and(|v| values.contains(v)),
            "NotIn" => got.is_none_or(|v| !values.contains(v)),
            "Exists" => got.is_some(),
            "DoesNotExist" => got.is_none(),
            _ => false,
        }
    });
    by_labels && by_expressions
}

/// The planner's conditions as metav1 Conditions: `lastTransitionTime` kept from `previous`
/// while the status stays, now otherwise.
pub fn conditions(
    planned: &[Condition],
    previous: &[MetaCondition],
    generation: Option<i64>,
    now: &Time,
) -> Vec<MetaCondition> {
    planned
        .iter()
        .map(|c| {
            let status = if c.status { "True" } else { "False" };
            let since = previous
                .iter()
                .find(|p| p.type_ == c.kind && p.status == status)
                .map(|p| p.last_transition_time.clone())
                .unwrap_or_else(|| now.clone());
            MetaCondition {
                type_: c.kind.to_owned(),
                status: status.to_owned(),
                reason: c.reason.to_owned(),
                message: c.message.clone(),
                last_transition_time: since,
                observed_generation: generation,
            }
        })
        .collect()
}

/// The conditions of a refused spec: Degraded (the refusal's reason, the message naming the
/// field) and not Progressing; Available as it was.
pub fn refused(
    e: &Invalid,
    previous: &[MetaCondition],
    generation: Option<i64>,
    now: &Time,
) -> Vec<MetaCondition> {
    let text = e.to_string();
    let mut out = conditions(
        &[
            Condition {
                kind: "Progressing",
                status: false,
                reason: e.reason,
                message: text.clone(),
            },
            Condition {
                kind: "Degraded",
                status: true,
                reason: e.reason,
                message: text,
            },
        ],
        previous,
        generation,
        now,
    );
    if let Some(a) = previous.iter().find(|c| c.type_ == "Available") {
        out.insert(0, a.clone());
    }
    out
}

/// The status counts as the resource writes them.
pub fn counts(c: &Counts, replicas: usize) -> (i32, i32, i32, i32) {
    let n = |v: usize| i32::try_from(v).unwrap_or(i32::MAX);
    (
        n(c.replicas),
        n(c.ready_replicas),
        n(c.updated_replicas),
        n(replicas.saturating_sub(c.ready_replicas)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt as _;

    fn raw(name: &str) -> Value {
        json!({
            "apiVersion": "etcd-warden.io/v1alpha1", "kind": "ControlPlaneSet",
            "metadata": {"name": name, "namespace": "openshift-machine-api", "generation": 4},
            "spec": {
                "replicas": 3,
                "strategy": {"type": "RollingUpdate"},
                "failureDomains": {"platform": "AWS", "domains": ["us-east-1a", "us-east-1b"]},
                "selector": {"matchLabels": {"role": "master"}},
                "template": {
                    "metadata": {"labels": {"role": "master", "extra": "x"}},
                    "spec": {"providerSpec": {"value": {"instanceType": "m6i.xlarge"}}}
                }
            }
        })
    }

    fn degraded(e: &Invalid) -> MetaCondition {
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        refused(e, &[], Some(4), &now)
            .into_iter()
            .find(|c| c.type_ == "Degraded")
            .unwrap()
    }

    #[test]
    fn a_valid_set_maps_onto_the_planner_config() {
        let v = validate(&raw(NAME), None).unwrap();
        assert_eq!(v.config.replicas, 3);
        assert_eq!(v.config.strategy, Strategy::RollingUpdate);
        assert_eq!(v.config.failure_domains, ["us-east-1a", "us-east-1b"]);
        assert_eq!(v.field, DomainField::AWS);
        assert_eq!(v.selector, "role=master");
        assert_eq!(
            v.config.template,
            json!({"providerSpec": {"value": {"instanceType": "m6i.xlarge"}}})
        );
        // Defaults: replicas 3, RollingUpdate, one anonymous domain.
        let mut r = raw(NAME);
        let spec = r["spec"].as_object_mut().unwrap();
        spec.remove("replicas");
        spec.remove("strategy");
        spec.remove("failureDomains");
        let v = validate(&r, None).unwrap();
        assert_eq!(
            (v.config.replicas, v.config.strategy),
            (3, Strategy::RollingUpdate)
        );
        assert!(v.config.failure_domains.is_empty());
    }

    #[test]
    fn a_replicas_change_is_refused_with_a_degraded_condition_naming_the_field() {
        let accepted = validate(&raw(NAME), None).unwrap().accepted;
        let mut r = raw(NAME);
        r["spec"]["replicas"] = json!(5);
        let e = validate(&r, Some(&accepted)).unwrap_err();
        assert_eq!(e.field, "spec.replicas");
        let d = degraded(&e);
        assert_eq!(
            (d.status.as_str(), d.reason.as_str()),
            ("True", "InvalidSpec")
        );
        assert!(
            d.message.starts_with("spec.replicas: is immutable"),
            "{}",
            d.message
        );
        assert_eq!(d.observed_generation, Some(4));
        // Not 3 or 5 at all.
        r["spec"]["replicas"] = json!(4);
        assert_eq!(validate(&r, None).unwrap_err().field, "spec.replicas");
    }

    #[test]
    fn a_selector_change_is_refused_with_a_degraded_condition_naming_the_field() {
        let accepted = validate(&raw(NAME), None).unwrap().accepted;
        let mut r = raw(NAME);
        r["spec"]["selector"] = json!({"matchLabels": {"role": "master", "extra": "x"}});
        let e = validate(&r, Some(&accepted)).unwrap_err();
        assert_eq!(e.field, "spec.selector");
        assert!(degraded(&e).message.contains("spec.selector: is immutable"));
        // A selector the template's labels do not match, on first sight.
        r["spec"]["selector"] = json!({"matchLabels": {"role": "worker"}});
        let e = validate(&r, None).unwrap_err();
        assert_eq!(e.field, "spec.selector");
        assert!(e.message.contains("template.metadata.labels"));
        r["spec"]["selector"] =
            json!({"matchExpressions": [{"key": "extra", "operator": "NotIn", "values": ["x"]}]});
        assert_eq!(validate(&r, None).unwrap_err().field, "spec.selector");
        r["spec"]["selector"] = json!({});
        assert_eq!(validate(&r, None).unwrap_err().field, "spec.selector");
    }

    #[test]
    fn state_defaults_to_active_and_goes_from_inactive_to_active_only() {
        let v = validate(&raw(NAME), None).unwrap();
        assert!(v.active, "absent: Active");
        let mut r = raw(NAME);
        r["spec"]["state"] = json!("Inactive");
        let inactive = validate(&r, None).unwrap();
        assert!(!inactive.active);
        r["spec"]["state"] = json!("Active");
        let active = validate(&r, Some(&inactive.accepted)).unwrap();
        assert!(active.active);
        r["spec"]["state"] = json!("Inactive");
        let e = validate(&r, Some(&active.accepted)).unwrap_err();
        assert_eq!(e.field, "spec.state");
        r["spec"]["state"] = json!("Paused");
        assert_eq!(validate(&r, None).unwrap_err().field, "spec.state");
        let crd = serde_json::to_value(ControlPlaneSet::crd()).unwrap();
        let state = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["properties"]["state"];
        assert_eq!(state["enum"], json!(["Active", "Inactive"]));
        assert_eq!(
            state["x-kubernetes-validations"][0]["rule"],
            "self == oldSelf || self == 'Active'"
        );
    }

    #[test]
    fn a_set_not_named_cluster_is_refused_naming_metadata_name() {
        let e = validate(&raw("other"), None).unwrap_err();
        assert_eq!(e.field, "metadata.name");
        let d = degraded(&e);
        assert!(d.message.starts_with("metadata.name: "), "{}", d.message);
        assert!(d.message.contains("'cluster'"));
    }

    #[test]
    fn a_bad_enum_is_refused_with_its_path() {
        let mut r = raw(NAME);
        r["spec"]["strategy"]["type"] = json!("Sideways");
        let e = validate(&r, None).unwrap_err();
        assert_eq!(e.field, "spec.strategy.type");
        assert!(e.message.contains("Sideways"), "{}", e.message);
        let mut r = raw(NAME);
        r["spec"]["failureDomains"]["platform"] = json!("Mars");
        assert_eq!(
            validate(&r, None).unwrap_err().field,
            "spec.failureDomains.platform"
        );
        let mut r = raw(NAME);
        r["spec"]["failureDomains"]["domains"] = json!(["a", "a"]);
        assert_eq!(
            validate(&r, None).unwrap_err().field,
            "spec.failureDomains.domains"
        );
        let mut r = raw(NAME);
        r["spec"]["template"]["spec"]["providerSpec"]["value"] = json!("flat");
        assert_eq!(
            validate(&r, None).unwrap_err().field,
            "spec.template.spec.providerSpec.value"
        );
    }

    #[test]
    fn a_new_set_must_fit_the_machines_it_takes_over() {
        assert!(fits_existing(3, 3).is_ok());
        for existing in [0, 2, 5] {
            let e = fits_existing(3, existing).unwrap_err();
            assert_eq!(e.field, "spec.replicas");
            assert!(
                degraded(&e)
                    .message
                    .contains(&format!("{existing} control-plane Machines"))
            );
        }
    }

    #[test]
    fn a_strategy_the_quorum_operator_cannot_carry_out_is_refused() {
        use crate::operator::quorum::plan::Replacement;
        assert!(fits_quorum_operator(Strategy::RollingUpdate, Replacement::Surge).is_ok());
        assert!(fits_quorum_operator(Strategy::OnDelete, Replacement::OnDeletion).is_ok());
        let e = fits_quorum_operator(Strategy::RollingUpdate, Replacement::OnDeletion).unwrap_err();
        assert_eq!(e.field, "spec.strategy.type");
        let d = degraded(&e);
        assert_eq!(d.reason, "QuorumOperatorMismatch");
        assert!(
            d.message
                .starts_with("spec.strategy.type: RollingUpdate needs"),
            "{}",
            d.message
        );
    }

    #[test]
    fn a_condition_keeps_its_transition_time_while_its_status_stays() {
        let then = Time(k8s_openapi::jiff::Timestamp::from_second(1_700_000_000).unwrap());
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let planned = |status| Condition {
            kind: "Available",
            status,
            reason: "AsExpected",
            message: String::new(),
        };
        let first = conditions(&[planned(true)], &[], Some(1), &then);
        let same = conditions(&[planned(true)], &first, Some(2), &now);
        assert_eq!(same[0].last_transition_time, then);
        assert_eq!(same[0].observed_generation, Some(2));
        let flipped = conditions(&[planned(false)], &first, Some(2), &now);
        assert_eq!(flipped[0].last_transition_time, now);
    }

    #[test]
    fn the_generated_crd_carries_the_rules_and_enums() {
        let crd = serde_json::to_value(ControlPlaneSet::crd()).unwrap();
        let v = &crd["spec"]["versions"][0];
        assert_eq!(crd["spec"]["group"], "etcd-warden.io");
        assert_eq!(crd["spec"]["scope"], "Namespaced");
        assert_eq!(v["name"], "v1alpha1");
        assert_eq!(v["subresources"]["status"], json!({}));
        let schema = &v["schema"]["openAPIV3Schema"];
        let rules = |at: &Value| -> Vec<String> {
            at["x-kubernetes-validations"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|r| r["rule"].as_str().unwrap().to_owned())
                        .collect()
                })
                .unwrap_or_default()
        };
        assert!(rules(schema).contains(&"self.metadata.name == 'cluster'".to_owned()));
        let spec = &schema["properties"]["spec"];
        assert!(
            rules(spec)
                .iter()
                .any(|r| r.contains("self.selector.matchLabels.all")),
            "{:?}",
            rules(spec)
        );
        let props = &spec["properties"];
        assert_eq!(rules(&props["replicas"]), ["self == oldSelf"]);
        assert_eq!(props["replicas"]["enum"], json!([3, 5]));
        assert_eq!(props["replicas"]["type"], "integer");
        assert_eq!(props["replicas"]["default"], json!(3));
        assert_eq!(rules(&props["selector"]), ["self == oldSelf"]);
        assert_eq!(
            props["strategy"]["properties"]["type"]["enum"],
            json!(["RollingUpdate", "Recreate", "OnDelete"])
        );
        assert_eq!(
            props["failureDomains"]["properties"]["platform"]["enum"],
            json!(["AWS", "Azure", "GCP", "OpenStack", "VSphere"])
        );
        let value = &props["template"]["properties"]["spec"]["properties"]["providerSpec"]["properties"]
            ["value"];
        assert_eq!(value["x-kubernetes-preserve-unknown-fields"], true);
        let columns: Vec<&str> = v["additionalPrinterColumns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            columns,
            [
                "Desired",
                "Current",
                "Ready",
                "Updated",
                "Unavailable",
                "Strategy",
                "Age"
            ]
        );
    }
}
