{{/*
Chart name, truncated to the 63-character DNS label limit.
*/}}
{{- define "broker-lookup.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name (release + chart unless the release name already holds
the chart name). Truncated to 40 so that "-worker-headless" fits 63 and StatefulSet names stay
under 52 (pod names add "-<ordinal>", revision labels add a hash).
*/}}
{{- define "broker-lookup.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "broker-lookup.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Standard labels on every object.
*/}}
{{- define "broker-lookup.labels" -}}
helm.sh/chart: {{ include "broker-lookup.chart" . }}
{{ include "broker-lookup.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: broker-lookup
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels: only immutable ones (name + instance; component is added per workload).
*/}}
{{- define "broker-lookup.selectorLabels" -}}
app.kubernetes.io/name: {{ include "broker-lookup.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "broker-lookup.workerSelectorLabels" -}}
{{ include "broker-lookup.selectorLabels" . }}
app.kubernetes.io/component: worker
{{- end }}

{{- define "broker-lookup.exporterSelectorLabels" -}}
{{ include "broker-lookup.selectorLabels" . }}
app.kubernetes.io/component: exporter
{{- end }}

{{- define "broker-lookup.exporterFullname" -}}
{{- printf "%s-exporter" (include "broker-lookup.fullname" .) }}
{{- end }}

{{- define "broker-lookup.querySelectorLabels" -}}
{{ include "broker-lookup.selectorLabels" . }}
app.kubernetes.io/component: query
{{- end }}

{{- define "broker-lookup.queryFullname" -}}
{{- printf "%s-query" (include "broker-lookup.fullname" .) }}
{{- end }}

{{- define "broker-lookup.redisSelectorLabels" -}}
{{ include "broker-lookup.selectorLabels" . }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "broker-lookup.workerFullname" -}}
{{- printf "%s-worker" (include "broker-lookup.fullname" .) }}
{{- end }}

{{- define "broker-lookup.redisFullname" -}}
{{- printf "%s-redis" (include "broker-lookup.fullname" .) }}
{{- end }}

{{- define "broker-lookup.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "broker-lookup.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
image reference: repository@digest when a digest is set, else repository:tag.
Call with (dict "image" .Values.image "default" .Chart.AppVersion "key" "image").
*/}}
{{- define "broker-lookup.imageRef" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- $tag := default .default .image.tag | toString }}
{{- if not $tag }}
{{- fail (printf "%s: set tag or digest" .key) }}
{{- end }}
{{- printf "%s:%s" .image.repository $tag }}
{{- end }}
{{- end }}

{{/*
The broker-lookup image (exporter, helm tests, reference workers). No public registry
serves it, so a repository must be set: fail with how to get one rather than render an
image reference no node can pull.
*/}}
{{- define "broker-lookup.image" -}}
{{- if not .Values.image.repository }}
{{- fail "image.repository is not set: build the broker-lookup image from deploy/Dockerfile, push it to a registry your nodes pull from and set --set image.repository=<registry>/broker-lookup (no public registry serves it yet; see the README's Deploy section)" }}
{{- end }}
{{- include "broker-lookup.imageRef" (dict "image" .Values.image "default" .Chart.AppVersion "key" "image") }}
{{- end }}

{{/*
Name and key of the Secret holding the Redis password.
*/}}
{{- define "broker-lookup.secretName" -}}
{{- if .Values.auth.existingSecret }}
{{- tpl .Values.auth.existingSecret . }}
{{- else }}
{{- printf "%s-redis-auth" (include "broker-lookup.fullname" .) }}
{{- end }}
{{- end }}

{{- define "broker-lookup.secretPasswordKey" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecretPasswordKey }}
{{- else }}
{{- print "redis-password" }}
{{- end }}
{{- end }}

{{/*
Redis URL the workers and the test hook use (never contains the password).
*/}}
{{- define "broker-lookup.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s:%d/0" (include "broker-lookup.redisFullname" .) (int .Values.redis.port) }}
{{- else }}
{{- .Values.externalRedis.url }}
{{- end }}
{{- end }}

{{/*
In-cluster DNS name of the bundled Redis Service.
*/}}
{{- define "broker-lookup.redisHost" -}}
{{- printf "%s.%s.svc" (include "broker-lookup.redisFullname" .) .Release.Namespace }}
{{- end }}

{{/*
Fail early on combinations that cannot work.
*/}}
{{- define "broker-lookup.validate" -}}
{{- if and (not .Values.redis.enabled) (not .Values.externalRedis.url) }}
{{- fail "redis.enabled=false needs externalRedis.url (e.g. redis://redis.cache.svc:6379/0)" }}
{{- end }}
{{- if and .Values.redis.enabled .Values.externalRedis.url }}
{{- fail "set either redis.enabled=true or externalRedis.url, not both" }}
{{- end }}
{{- if regexMatch "^rediss?://[^/@]*:[^/@]*@" .Values.externalRedis.url }}
{{- fail "externalRedis.url must not contain a password: put it in auth.existingSecret (key auth.existingSecretPasswordKey)" }}
{{- end }}
{{- if and .Values.auth.enabled (not .Values.redis.enabled) (not .Values.auth.existingSecret) (not .Values.auth.password) }}
{{- fail "external Redis with auth.enabled=true needs auth.existingSecret (or auth.password); a generated password would not match the server" }}
{{- end }}
{{- if include "broker-lookup.aclEnabled" . }}
{{- range (include "broker-lookup.aclEngines" . | fromJsonArray) }}
{{- if not (regexMatch "^[A-Za-z0-9_.-]{1,100}$" .) }}
{{- fail (printf "engine id %q: with auth.acl.enabled, an engine id is 1-100 characters of A-Z a-z 0-9 _ . - (it names ACL users and Secret keys)" .) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.pdb.enabled (not (kindIs "invalid" .Values.pdb.minAvailable)) (not (kindIs "invalid" .Values.pdb.maxUnavailable)) }}
{{- fail "pdb: set only one of minAvailable and maxUnavailable (set the other to null)" }}
{{- end }}
{{- end }}

{{/*
"true" when the server's users come from ACLs (auth and auth.acl on). Empty otherwise.
*/}}
{{- define "broker-lookup.aclEnabled" -}}
{{- if and .Values.auth.enabled .Values.auth.acl.enabled }}
{{- print "true" }}
{{- end }}
{{- end }}

{{/*
The engines with ACL users, as a JSON list: engine.id, then auth.acl.extraEngines.
*/}}
{{- define "broker-lookup.aclEngines" -}}
{{- prepend .Values.auth.acl.extraEngines .Values.engine.id | uniq | toJson }}
{{- end }}

{{/*
Every ACL user as a JSON list of {user, role, engine}: per engine its scheduler, worker,
vllm and operator users (named <role>-<engine>), then the fleet-wide `exporter`
(operator role, every engine), `admin` and, with the query endpoint, `router` (router
role, every engine). A user's password is the Secret's key of
the same name. The roles' commands and key patterns are files/acl-roles.json, which is
generated from broker_lookup/ops/acl.py.
*/}}
{{- define "broker-lookup.aclUsers" -}}
{{- $users := list }}
{{- range (include "broker-lookup.aclEngines" . | fromJsonArray) }}
{{- $engine := . }}
{{- range (list "scheduler" "worker" "vllm" "operator") }}
{{- $users = append $users (dict "user" (printf "%s-%s" . $engine) "role" . "engine" $engine) }}
{{- end }}
{{- end }}
{{- $users = append $users (dict "user" "exporter" "role" "operator" "engine" "") }}
{{- $users = append $users (dict "user" "admin" "role" "admin" "engine" "") }}
{{- if .Values.queryEndpoint.enabled }}
{{- $users = append $users (dict "user" "router" "role" "router" "engine" "") }}
{{- end }}
{{- toJson $users }}
{{- end }}

{{/*
One ACL file line for a user of aclUsers, its password as the placeholder @PW_<index>@
that the server's init container replaces with `#<sha256 of the password>`.
Call with (dict "u" <user> "index" <i> "roles" <acl-roles.json>).
*/}}
{{- define "broker-lookup.aclLine" -}}
{{- $words := list "user" .u.user "on" (printf "@PW_%d@" .index) "resetkeys" "resetchannels" }}
{{- if eq .u.role "router" }}
{{- $words = concat $words .roles.router_key_patterns }}
{{- else if ne .u.role "admin" }}
{{- if .u.engine }}
{{- range .roles.engine_key_patterns }}
{{- $words = append $words (printf . $.u.engine) }}
{{- end }}
{{- else }}
{{- $words = concat $words .roles.fleet_key_patterns }}
{{- end }}
{{- end }}
{{- $words = append $words "-@all" }}
{{- range (index .roles.commands .u.role) }}
{{- $words = append $words (printf "+%s" .) }}
{{- end }}
{{- join " " $words }}
{{- end }}

{{/*
The Redis credentials of one user: with ACLs its name and its password (the Secret's
key of that name); without, the one password. Call with (dict "ctx" $ "user" <name>).
*/}}
{{- define "broker-lookup.credentialsEnv" -}}
{{- $ctx := .ctx }}
{{- if $ctx.Values.auth.enabled }}
{{- $acl := include "broker-lookup.aclEnabled" $ctx }}
{{- if $acl }}
- name: BROKER_LOOKUP_REDIS_USERNAME
  value: {{ .user | quote }}
{{- end }}
- name: BROKER_LOOKUP_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "broker-lookup.secretName" $ctx }}
      key: {{ ternary .user (include "broker-lookup.secretPasswordKey" $ctx) (eq $acl "true") }}
{{- end }}
{{- end }}

{{/*
The environment of the reference workers and the test hook: the URL, the credentials
of (dict "ctx" $ "user" <acl user name>), the engine and its world size.
*/}}
{{- define "broker-lookup.redisEnv" -}}
{{- $ := .ctx }}
- name: BROKER_LOOKUP_REDIS_URL
  value: {{ include "broker-lookup.redisUrl" $ | quote }}
{{- include "broker-lookup.credentialsEnv" . }}
- name: BROKER_LOOKUP_ENGINE_ID
  value: {{ $.Values.engine.id | quote }}
- name: BROKER_LOOKUP_WORLD_SIZE
  value: {{ $.Values.engine.worldSize | quote }}
{{- end }}

{{/*
Worker config file content (null fields are left to the worker's defaults).
*/}}
{{- define "broker-lookup.workerConfig" -}}
{{- $cfg := dict }}
{{- range $k, $v := .Values.referenceWorkers.extraConfig }}
{{- if hasKey $.Values.referenceWorkers.config $k }}
{{- fail (printf "referenceWorkers.extraConfig.%s: set it as referenceWorkers.config.%s instead" $k $k) }}
{{- end }}
{{- end }}
{{- range $k, $v := merge (deepCopy .Values.referenceWorkers.config) .Values.referenceWorkers.extraConfig }}
{{- if not (kindIs "invalid" $v) }}
{{- $_ := set $cfg $k $v }}
{{- end }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/*
"true" when the ServiceMonitor renders: enabled, and the CRD's API is served
(or serviceMonitor.force, for helm template and tests). Empty otherwise.
*/}}
{{- define "broker-lookup.prometheusRuleEnabled" -}}
{{- if and .Values.prometheusRule.enabled (or .Values.prometheusRule.force (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) }}
{{- print "true" }}
{{- end }}
{{- end }}

{{- define "broker-lookup.serviceMonitorEnabled" -}}
{{- if and .Values.serviceMonitor.enabled (or .Values.serviceMonitor.force (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) }}
{{- print "true" }}
{{- end }}
{{- end }}
