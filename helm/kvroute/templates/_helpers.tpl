{{/* Names, labels and the pieces every workload shares. */}}

{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Resource name prefix, at most 45 characters: "<prefix>-worker" stays within the 52 that a
StatefulSet name may have (its pods' controller-revision-hash label adds 11 to it).
*/}}
{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvroute.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "router"). */}}
{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component: call with (dict "ctx" $ "component" "router"). */}}
{{- define "kvroute.labels" -}}
helm.sh/chart: {{ include "kvroute.chart" .ctx }}
{{ include "kvroute.podLabels" . }}
{{- end }}

{{/* The labels of one component's pods: all but the chart's version, which changes with
     any template's edit; on a pod template it restarted every router, NATS server and
     engine (reloading its model) at each chart upgrade. Call as kvroute.labels; a pod that
     runs another project's image (NATS) passes its own "version", or kvroute's version
     restarted it at every kvroute upgrade. */}}
{{- define "kvroute.podLabels" -}}
{{ include "kvroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .version | default .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: kvroute
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvroute.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* image: call with (dict "ctx" $ "image" .Values.image). */}}
{{- define "kvroute.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{- define "kvroute.natsName" -}}
{{- printf "%s-nats" (include "kvroute.fullname" .) }}
{{- end }}

{{/*
The NATS URL(s) router and workers connect to: the external URL list, or every bundled server
(the client reconnects to another when one goes away; a single server: its Service).
*/}}
{{- define "kvroute.natsUrl" -}}
{{- if eq .Values.nats.mode "external" }}
{{- required "nats.external.url is required when nats.mode is external" .Values.nats.external.url }}
{{- else }}
{{- $n := .Values.nats.bundled }}
{{- $name := include "kvroute.natsName" . }}
{{- if gt (int64 $n.replicas) 1 }}
{{- $urls := list }}
{{- range $i := until (int $n.replicas) }}
{{- $urls = append $urls (printf "nats://%s-%d.%s-headless.%s.svc.%s:4222" $name $i $name $.Release.Namespace $n.clusterDomain) }}
{{- end }}
{{- join "," $urls }}
{{- else }}
{{- printf "nats://%s:4222" $name }}
{{- end }}
{{- end }}
{{- end }}

{{/* Replicas of the registry bucket: the value, else 3 on a 3-server bundled NATS, else 1. */}}
{{- define "kvroute.registryReplicas" -}}
{{- if not (kindIs "invalid" .Values.nats.registryReplicas) }}
{{- .Values.nats.registryReplicas | int64 }}
{{- else if and (eq .Values.nats.mode "bundled") (gt (int64 .Values.nats.bundled.replicas) 1) }}
{{- .Values.nats.bundled.replicas | int64 }}
{{- else }}1{{- end }}
{{- end }}

{{/* "true" when the bundled NATS runs with token auth. */}}
{{- define "kvroute.natsBundledAuth" -}}
{{- if and (eq .Values.nats.mode "bundled") .Values.nats.bundled.auth.enabled }}true{{ end }}
{{- end }}

{{/* The Secret with the bundled NATS token: the user's, or the one the chart generates. */}}
{{- define "kvroute.natsAuthSecretName" -}}
{{- default (printf "%s-auth" (include "kvroute.natsName" .)) .Values.nats.bundled.auth.existingSecret }}
{{- end }}

{{/*
The generated token, base64: the one already in the cluster (an upgrade keeps it), else a new
random one. Letters and digits, a letter first: nats-server parses $NATS_TOKEN as a config
value, and a number or "true" would not be a string.
*/}}
{{- define "kvroute.natsGeneratedToken" -}}
{{- $key := .Values.nats.bundled.auth.tokenKey }}
{{- $secret := lookup "v1" "Secret" .Release.Namespace (include "kvroute.natsAuthSecretName" .) }}
{{- $data := dig "data" (dict) $secret }}
{{- if hasKey $data $key }}
{{- index $data $key }}
{{- else }}
{{- printf "%s%s" (randAlpha 1) (randAlphaNum 39) | b64enc }}
{{- end }}
{{- end }}

{{/* Where the NATS credential files from Secrets are mounted in router and worker pods. */}}
{{- define "kvroute.natsAuthDir" -}}/etc/kvroute-nats/auth{{- end }}
{{- define "kvroute.natsTlsCaDir" -}}/etc/kvroute-nats/tls-ca{{- end }}
{{- define "kvroute.natsTlsClientDir" -}}/etc/kvroute-nats/tls-client{{- end }}

{{/*
NATS credentials and TLS of router and workers, as environment variables: secrets straight
from their Secrets (secretKeyRef), files as paths into the Secret volumes below. A YAML list
(possibly empty), one item per line.
*/}}
{{- define "kvroute.natsClientEnv" -}}
{{- $n := .Values.nats }}
{{- if eq $n.mode "bundled" }}
{{- if $n.bundled.auth.enabled }}
- name: KVROUTE_NATS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kvroute.natsAuthSecretName" . }}
      key: {{ $n.bundled.auth.tokenKey | quote }}
{{- end }}
{{- else }}
{{- $a := $n.external.auth }}
{{- if eq $a.type "token" }}
- name: KVROUTE_NATS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $a.existingSecret }}
      key: {{ $a.tokenKey | quote }}
{{- else if eq $a.type "userPassword" }}
- name: KVROUTE_NATS_USER
  valueFrom:
    secretKeyRef:
      name: {{ $a.existingSecret }}
      key: {{ $a.userKey | quote }}
- name: KVROUTE_NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $a.existingSecret }}
      key: {{ $a.passwordKey | quote }}
{{- else if eq $a.type "creds" }}
- name: KVROUTE_NATS_CREDS_FILE
  value: {{ include "kvroute.natsAuthDir" . }}/nats.creds
{{- else if eq $a.type "nkey" }}
- name: KVROUTE_NATS_NKEY_SEED_FILE
  value: {{ include "kvroute.natsAuthDir" . }}/nkey.seed
{{- end }}
{{- $t := $n.external.tls }}
{{- if $t.ca.existingSecret }}
- name: KVROUTE_NATS_TLS_CA_FILE
  value: {{ include "kvroute.natsTlsCaDir" . }}/ca.crt
{{- end }}
{{- if $t.client.existingSecret }}
- name: KVROUTE_NATS_TLS_CERT_FILE
  value: {{ include "kvroute.natsTlsClientDir" . }}/tls.crt
- name: KVROUTE_NATS_TLS_KEY_FILE
  value: {{ include "kvroute.natsTlsClientDir" . }}/tls.key
{{- end }}
{{- if $t.required }}
- name: KVROUTE_NATS_TLS_REQUIRED
  value: "true"
{{- end }}
{{- end }}
{{- end }}

{{/* The Secret volumes behind kvroute.natsClientEnv's files (external NATS only). */}}
{{- define "kvroute.natsClientVolumes" -}}
{{- $n := .Values.nats }}
{{- if eq $n.mode "external" }}
{{- $a := $n.external.auth }}
{{- if has $a.type (list "creds" "nkey") }}
- name: nats-auth
  secret:
    secretName: {{ $a.existingSecret }}
    defaultMode: 0440
    items:
      {{- if eq $a.type "creds" }}
      - key: {{ $a.credsKey | quote }}
        path: nats.creds
      {{- else }}
      - key: {{ $a.nkeySeedKey | quote }}
        path: nkey.seed
      {{- end }}
{{- end }}
{{- with $n.external.tls.ca }}
{{- if .existingSecret }}
- name: nats-tls-ca
  secret:
    secretName: {{ .existingSecret }}
    defaultMode: 0444
    items:
      - key: {{ .key | quote }}
        path: ca.crt
{{- end }}
{{- end }}
{{- with $n.external.tls.client }}
{{- if .existingSecret }}
- name: nats-tls-client
  secret:
    secretName: {{ .existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .certKey | quote }}
        path: tls.crt
      - key: {{ .keyKey | quote }}
        path: tls.key
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Mounts of kvroute.natsClientVolumes. */}}
{{- define "kvroute.natsClientVolumeMounts" -}}
{{- $n := .Values.nats }}
{{- if eq $n.mode "external" }}
{{- if has $n.external.auth.type (list "creds" "nkey") }}
- name: nats-auth
  mountPath: {{ include "kvroute.natsAuthDir" . }}
  readOnly: true
{{- end }}
{{- if $n.external.tls.ca.existingSecret }}
- name: nats-tls-ca
  mountPath: {{ include "kvroute.natsTlsCaDir" . }}
  readOnly: true
{{- end }}
{{- if $n.external.tls.client.existingSecret }}
- name: nats-tls-client
  mountPath: {{ include "kvroute.natsTlsClientDir" . }}
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{/*
Pod settings every kvroute pod shares. No Kubernetes API access, and no service links: a
Service named "kvroute" in the namespace would otherwise inject KVROUTE_PORT=tcp://…, which
both binaries read as their --port.
*/}}
{{- define "kvroute.podCommon" -}}
serviceAccountName: {{ include "kvroute.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/* A number as a TOML float ("8" becomes "8.0"): the config's float keys. */}}
{{- define "kvroute.tomlFloat" -}}
{{- $s := toString (float64 .) }}
{{- if regexMatch "^-?[0-9]+$" $s }}{{ $s }}.0{{ else }}{{ $s }}{{ end }}
{{- end }}

{{/* Where the router's API keys file (router.apiKeys.existingSecret) is mounted. */}}
{{- define "kvroute.apiKeysDir" -}}/etc/kvroute-api-keys{{- end }}

{{/*
The router's TOML config (`kvroute serve --config`): keys are the flags in snake_case. No
secrets: those come from Secrets as environment variables or mounted files.
*/}}
{{- define "kvroute.routerConfig" -}}
{{- $r := .Values.router -}}
# kvroute serve --config: rendered by the kvroute chart.
nats = {{ include "kvroute.natsUrl" . | toJson }}
registry_replicas = {{ include "kvroute.registryReplicas" . }}
host = "0.0.0.0"
port = 8080
admin_host = {{ $r.admin.host | toJson }}
admin_port = {{ $r.admin.port | int64 }}
status_host = "0.0.0.0"
status_port = {{ $r.statusPort | int64 }}
{{- if $r.apiKeys.existingSecret }}
api_keys_file = {{ printf "%s/api-keys" (include "kvroute.apiKeysDir" .) | toJson }}
{{- end }}
cluster = {{ .Values.cluster | toJson }}
policy = {{ $r.policy | toJson }}
{{- if not (kindIs "invalid" $r.prefillScale) }}
prefill_scale = {{ include "kvroute.tomlFloat" $r.prefillScale }}
{{- end }}
{{- if not (kindIs "invalid" $r.decodeWeight) }}
decode_weight = {{ include "kvroute.tomlFloat" $r.decodeWeight }}
{{- end }}
{{- if not (kindIs "invalid" $r.temperature) }}
temperature = {{ include "kvroute.tomlFloat" $r.temperature }}
{{- end }}
lease_ttl_ms = {{ $r.leaseTtlMs | int64 }}
max_inflight = {{ $r.maxInflight | int64 }}
{{- range $key, $value := dict "max_body_bytes" $r.maxBodyBytes "body_memory_bytes" $r.bodyMemoryBytes "retries" $r.retries "retry_budget_percent" $r.retryBudgetPercent "retry_budget_per_s" $r.retryBudgetPerS "worker_timeout_ms" $r.workerTimeoutMs }}
{{- if not (kindIs "invalid" $value) }}
{{ $key }} = {{ $value | int64 }}
{{- end }}
{{- end }}
max_connections = {{ $r.maxConnections | int64 }}
header_read_timeout_ms = {{ $r.headerReadTimeoutMs | int64 }}
body_read_timeout_ms = {{ $r.bodyReadTimeoutMs | int64 }}
write_stall_timeout_ms = {{ $r.writeStallTimeoutMs | int64 }}
relay_idle_timeout_ms = {{ $r.relayIdleTimeoutMs | int64 }}
worker_pool_idle_ms = {{ $r.workerPoolIdleMs | int64 }}
upstream_body_timeout_ms = {{ $r.upstreamBodyTimeoutMs | int64 }}
first_token_timeout_ms = {{ $r.firstTokenTimeoutMs | int64 }}
max_upstream_body_bytes = {{ $r.maxUpstreamBodyBytes | int64 }}
tokenizer_threads = {{ $r.tokenizerThreads | int64 }}
max_tokenize_bytes = {{ $r.maxTokenizeBytes | int64 }}
route_headers = {{ $r.routeHeaders }}
drain_timeout_ms = {{ $r.drainTimeoutMs | int64 }}
{{- with $r.tokenizer }}
tokenizer = {{ . | toJson }}
{{- end }}
{{- with $r.chatTemplate }}
chat_template = {{ . | toJson }}
{{- end }}
{{- with $r.chatTemplateContentFormat }}
chat_template_content_format = {{ . | toJson }}
{{- end }}
{{- with $r.defaultChatTemplateKwargs }}
default_chat_template_kwargs = {{ . | toJson | toJson }}
{{- end }}
trust_request_chat_template = {{ $r.trustRequestChatTemplate }}
exclude_tools_when_tool_choice_none = {{ $r.excludeToolsWhenToolChoiceNone }}
log_format = {{ $r.logFormat | toJson }}
{{- with $r.backends }}
backends = {{ . | toJson }}
{{- end }}
{{- end }}

{{/*
The bundled NATS server's config (nats.conf); $SERVER_NAME comes from the pod name, and with
auth $NATS_TOKEN and $NATS_ROUTE_<i> from the token Secret: nothing secret in the ConfigMap.
*/}}
{{- define "kvroute.natsConfig" -}}
{{- $n := .Values.nats.bundled -}}
{{- $name := include "kvroute.natsName" . -}}
{{- $auth := include "kvroute.natsBundledAuth" . -}}
server_name: $SERVER_NAME
port: 4222
http_port: 8222
pid_file: "/var/run/nats/nats.pid"
lame_duck_duration: "{{ $n.lameDuckSeconds | int64 }}s"
lame_duck_grace_period: "10s"
jetstream {
  store_dir: "/data"
  max_memory_store: {{ $n.jetstream.maxMemoryStore }}
  max_file_store: {{ $n.jetstream.maxFileStore }}
}
{{- if $auth }}
# Clients (router, workers) present the token from the pod's environment.
authorization {
  token: $NATS_TOKEN
}
{{- end }}
{{- if gt (int64 $n.replicas) 1 }}
cluster {
  name: {{ $name | quote }}
  port: 6222
  {{- if $auth }}
  # Servers of the cluster authenticate to each other with the same token; the route URLs
  # (with it) come from the environment.
  authorization {
    user: route
    password: $NATS_TOKEN
  }
  routes: [
    {{- range $i := until (int $n.replicas) }}
    $NATS_ROUTE_{{ $i }}
    {{- end }}
  ]
  {{- else }}
  routes: [
    {{- range $i := until (int $n.replicas) }}
    {{ include "kvroute.natsRouteUrl" (dict "ctx" $ "index" $i "auth" "") | quote }}
    {{- end }}
  ]
  {{- end }}
}
{{- end }}
{{- end }}

{{/* The cluster route URL of bundled server `index`: (dict "ctx" $ "index" 0 "auth" "user:pass@"). */}}
{{- define "kvroute.natsRouteUrl" -}}
{{- $name := include "kvroute.natsName" .ctx -}}
{{- printf "nats://%s%s-%d.%s-headless.%s.svc.%s:6222" .auth $name (int .index) $name .ctx.Release.Namespace .ctx.Values.nats.bundled.clusterDomain }}
{{- end }}

{{/*
The engines' API key (vLLM/SGLang started with --api-key) as container environment: the
router and the sidecars send it (KVROUTE_ENGINE_API_KEY); call with the root context.
*/}}
{{- define "kvroute.engineApiKeyEnv" -}}
{{- with .Values.engineApiKey.existingSecret }}
- name: KVROUTE_ENGINE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.engineApiKey.key | quote }}
{{- end }}
{{- end }}
